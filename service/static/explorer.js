// latentlm model explorer: plain JavaScript and SVG, no libraries, no build step, no network but the server.
// Every call goes through the public REST API (relative URLs, so the page works under a proxy's path
// prefix) and carries the API key the user saved (localStorage), as `Authorization: Bearer <key>`.
"use strict";

(() => {
  const KEY_STORE = "latentlm.apiKey";
  const MODEL_STORE = "latentlm.model";
  const TEXT_STORE = "latentlm.text";
  const BASE = new URL(".", document.baseURI); // the page's directory
  const SVGNS = "http://www.w3.org/2000/svg";
  const TREE_FAMILIES = new Set(["pcfg", "dense_pcfg"]);
  const TEXT_VIEWS = ["surprisal", "posterior", "parse", "embeddings"]; // recomputed by Analyze

  const $ = (sel, root = document) => root.querySelector(sel);
  const state = { models: [], model: null, text: "", view: "surprisal", parse: null, unkIds: new Map() };
  const gens = {}; // view -> generation: a result that arrives after a newer run (or a reset) is dropped
  const bump = (view) => (gens[view] = (gens[view] || 0) + 1);

  // -- DOM helpers --------------------------------------------------------------------------------------
  function build(ns, tag, attrs, children) {
    const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children || []) if (c !== null && c !== undefined) e.append(c);
    return e;
  }
  const h = (tag, attrs, ...children) => build(null, tag, attrs, children);
  const s = (tag, attrs, ...children) => build(SVGNS, tag, attrs, children);
  const clear = (e) => { while (e.firstChild) e.firstChild.remove(); return e; };
  const fmt = (x, d = 3) => (x === null || x === undefined ? "∞" : Number(x).toFixed(d));
  const titled = (node, text) => { node.append(s("title", { text })); return node; };

  // -- API ----------------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message, param) { super(message); this.status = status; this.param = param; }
  }

  function headers(json) {
    const out = json ? { "Content-Type": "application/json" } : {};
    const key = localStorage.getItem(KEY_STORE);
    if (key) out.Authorization = "Bearer " + key;
    return out;
  }

  async function request(path, body) {
    const init = body === undefined ? { headers: headers(false) }
      : { method: "POST", headers: headers(true), body: JSON.stringify(body) };
    let r;
    try {
      r = await fetch(new URL(path, BASE), init);
    } catch (e) {
      throw new ApiError(0, `cannot reach the server (${e.message})`, null);
    }
    if (r.ok) return r;
    let message = `HTTP ${r.status}`, param = null;
    try {
      const e = (await r.json()).error;
      message = e.message; param = e.param;
    } catch (_) { /* not the service's error shape */ }
    if (r.status === 401) message += ". Enter the server's API key at the top right and save it.";
    throw new ApiError(r.status, message, param);
  }
  const getJSON = async (path) => (await request(path)).json();
  const post = async (path, body) => (await request(path, body)).json();
  const modelPath = (m) => "v1/models/" + encodeURIComponent(m.id);

  // -- small model facts --------------------------------------------------------------------------------
  const can = (m, op) => (m.operations || []).includes(op);
  const isTree = (m) => TREE_FAMILIES.has(m.family);
  const VIEWS = {
    surprisal: (m) => can(m, "score"),
    posterior: (m) => can(m, "posterior") && !isTree(m),
    parse: (m) => isTree(m) && can(m, "decode"),
    embeddings: (m) => can(m, "embed"),
    sampling: (m) => can(m, "sample"),
    constraints: (m) => can(m, "constraint"),
    card: () => true,
  };

  /** The words of `text` as the server's whitespace tokenizer sees them (lowercased if the manifest says so). */
  function wordsOf(m, text) {
    const p = m.preprocessing || {};
    return (p.lowercase ? text.toLowerCase() : text).split(/\s+/).filter(Boolean);
  }

  /** The tokens the server will see for `text` (its whitespace tokenizer, as the manifest says). */
  function tokenize(m, text) {
    const p = m.preprocessing || {};
    const words = wordsOf(m, text);
    if (p.add_eos && p.eos && words.length) words.push(p.eos);
    return words;
  }

  /** Display labels for the tokens of `text`: the typed word, `unk` where the model scored it as <unk>. */
  function labels(m, text, served) {
    const typed = tokenize(m, text);
    const unk = (m.preprocessing || {}).unk;
    if (!served || served.length !== typed.length) {
      return (served || typed).map((w) => ({ word: w, unk: !!unk && w === unk }));
    }
    return served.map((w, i) => ({ word: typed[i], unk: !!unk && w === unk && typed[i] !== unk }));
  }

  // -- status, views ------------------------------------------------------------------------------------
  function status(msg, isError = false) {
    const e = $("#status");
    e.textContent = msg;
    e.classList.toggle("error", isError);
  }

  function section(view) { return $("#view-" + view); }

  function viewState(view, st, msg = "") {
    const sec = section(view);
    sec.dataset.state = st;
    $(".view-status", sec).textContent = st === "loading" ? "computing…" : "";
    $(".error", sec).textContent = st === "error" ? msg : "";
  }

  function showView(view) {
    state.view = view;
    for (const b of document.querySelectorAll("#tabs button")) {
      b.setAttribute("aria-selected", String(b.dataset.view === view));
    }
    for (const sec of document.querySelectorAll(".view")) sec.hidden = sec.id !== "view-" + view;
  }

  function updateTabs() {
    const m = state.model;
    for (const b of document.querySelectorAll("#tabs button")) b.hidden = !m || !VIEWS[b.dataset.view](m);
    if (m && !VIEWS[state.view](m)) showView(Object.keys(VIEWS).find((v) => VIEWS[v](m)));
  }

  /** Run `fn` for a view, showing its progress and error; results of a superseded run are dropped. */
  async function runView(view, fn) {
    const gen = bump(view);
    viewState(view, "loading");
    try {
      const render = await fn();
      if (gen !== gens[view]) return;
      render();
      viewState(view, "done");
    } catch (e) {
      if (gen !== gens[view]) return;
      viewState(view, "error", e.message);
      if (e.status === 401) status(e.message, true);
    }
  }

  // -- models ---------------------------------------------------------------------------------------------
  async function loadModels() {
    let data;
    try {
      data = (await getJSON("v1/models")).data;
    } catch (e) {
      status(e.message, true);
      if (e.status === 401) $("#api-key").focus();
      return;
    }
    if (!data.length) {
      status("No models are loaded yet (the server may still be loading them); retrying…");
      setTimeout(loadModels, 2000);
      return;
    }
    state.models = data;
    const sel = clear($("#model"));
    for (const m of data) sel.append(h("option", { value: m.id, text: `${m.id} (${m.family})` }));
    const saved = localStorage.getItem(MODEL_STORE);
    sel.value = data.some((m) => m.id === saved) ? saved : data[0].id;
    status(`${data.length} model${data.length > 1 ? "s" : ""} served`);
    selectModel(sel.value);
  }

  function selectModel(id) {
    const m = state.models.find((x) => x.id === id);
    if (!m) return;
    state.model = m;
    localStorage.setItem(MODEL_STORE, id);
    const sizes = ["num_states", "rank", "nt", "pt", "dim", "num_clusters"]
      .filter((k) => m[k] !== undefined && m[k] !== null).map((k) => `${k} ${m[k]}`);
    $("#model-summary").textContent = `${m.family} · vocabulary ${m.vocab_size} · ${sizes.join(" · ")}`;
    for (const v of [...TEXT_VIEWS, "sampling", "constraints"]) resetView(v);
    updateTabs();
    setupSampling(m);
    loadCard(m);
    if ($("#text").value.trim()) analyze();
  }

  function resetView(view) {
    bump(view);
    const sec = section(view);
    delete sec.dataset.state;
    $(".view-status", sec).textContent = "";
    $(".error", sec).textContent = "";
    for (const e of sec.querySelectorAll("svg")) { clear(e); e.setAttribute("width", 0); e.setAttribute("height", 0); }
    for (const e of sec.querySelectorAll(".summary, .tokens, .detail, .legend, #samples, #sample-usage")) clear(e);
    for (const e of sec.querySelectorAll("#constraint-automaton, #constraint-legend, #constraint-samples, #constraint-usage")) clear(e);
    clearFieldErrors(sec);
  }

  function analyze() {
    const m = state.model;
    const text = $("#text").value.trim();
    if (!m) return;
    if (!text) { status("Type a sentence first.", true); return; }
    localStorage.setItem(TEXT_STORE, text);
    state.text = text;
    for (const v of TEXT_VIEWS) resetView(v);
    if (!$("#prefix").dataset.edited && !isTree(m)) $("#prefix").value = text;
    const scored = can(m, "score") ? post("v1/score", { model: m.id, input: text, token_logprobs: !isTree(m) }) : null;
    if (scored) scored.catch(() => {}); // each view reports its own error
    if (VIEWS.surprisal(m)) runView("surprisal", () => surprisal(m, text, scored));
    if (VIEWS.posterior(m)) runView("posterior", () => posterior(m, text, scored));
    if (VIEWS.parse(m)) runView("parse", () => parse(m, text));
    if (VIEWS.embeddings(m)) runView("embeddings", () => embeddings(m, text, scored));
  }

  // -- surprisal ------------------------------------------------------------------------------------------
  const HEAT = [[255, 247, 188], [254, 217, 118], [254, 153, 41], [236, 112, 20], [204, 76, 2], [140, 45, 4]];
  function heat(t) {
    const x = Math.min(1, Math.max(0, t)) * (HEAT.length - 1);
    const i = Math.min(HEAT.length - 2, Math.floor(x)), f = x - i;
    const c = HEAT[i].map((v, k) => Math.round(v + f * (HEAT[i + 1][k] - v)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  async function surprisal(m, text, scored) {
    const r = (await scored).data[0];
    return () => {
      const bitsMax = Math.ceil(Math.log2(Math.max(2, m.vocab_size))) + 4;
      const words = labels(m, text, r.tokens);
      $("#surprisal-summary").replaceChildren(
        "perplexity ", h("b", { id: "perplexity", text: r.perplexity === null ? "∞ (probability 0)" : fmt(r.perplexity, 2) }),
        ` · log p = ${fmt(r.logprob, 3)} nats · ${r.num_tokens} tokens`,
        r.tokens && r.tokens[r.tokens.length - 1] === (m.preprocessing || {}).eos ? " (with the end-of-sentence token)" : "");
      const box = $("#surprisal-tokens");
      const detail = $("#surprisal-detail");
      if (!r.token_logprobs) {
        for (const w of words) box.append(h("span", { class: "tok plain" + (w.unk ? " unk" : "") }, h("span", { class: "w", text: w.word })));
        detail.replaceChildren(h("span", { class: "note", text: `A ${m.family} scores whole sentences: it has no per-token conditionals p(x_t | x_<t).` }));
        return;
      }
      words.forEach((w, i) => {
        const lp = r.token_logprobs[i];
        const bits = lp === null ? Infinity : -lp / Math.LN2;
        const t = bits / bitsMax;
        const tok = h("span", {
          class: "tok" + (w.unk ? " unk" : ""), "data-i": i, "data-logprob": lp,
          style: `background:${heat(t)};color:${t > 0.62 ? "#fff" : "#1d232b"}`,
          title: `${w.word}${w.unk ? " (scored as " + m.preprocessing.unk + ")" : ""}: log p = ${fmt(lp, 4)}`,
        }, h("span", { class: "w", text: w.word }), h("span", { class: "v", text: `${fmt(bits, 1)} bits` }));
        const show = () => {
          for (const x of box.querySelectorAll(".tok.active")) x.classList.remove("active");
          tok.classList.add("active");
          detail.replaceChildren(h("b", { text: w.word }), ` · position ${i} · log p(x_t | x_<t) = `,
            h("b", { class: "detail-logprob", text: fmt(lp, 4) }), ` nats · p = ${lp === null ? 0 : Math.exp(lp).toPrecision(3)}`,
            ` · surprisal ${fmt(bits, 2)} bits`,
            w.unk ? h("span", { class: "unk-note", style: "color:var(--unk);font-weight:700",
              text: ` · not in the vocabulary: scored as ${m.preprocessing.unk}` }) : "");
        };
        tok.addEventListener("mouseenter", show);
        tok.addEventListener("focus", show);
        tok.tabIndex = 0;
        box.append(tok);
      });
      const stops = [0, 0.2, 0.4, 0.6, 0.8, 1].map((t) => heat(t)).join(",");
      $("#surprisal-legend").replaceChildren("0 bits", h("span", { class: "bar", style: `background:linear-gradient(90deg,${stops})` }),
        `${bitsMax} bits · a uniform guess over the vocabulary costs ${fmt(Math.log2(m.vocab_size), 1)} bits · dashed: <unk>`);
    };
  }

  // -- posterior heatmap ----------------------------------------------------------------------------------
  function blues(p) {
    const t = Math.pow(Math.min(1, Math.max(0, p)), 0.6);
    const a = [247, 251, 255], b = [8, 48, 107];
    return `rgb(${a.map((v, k) => Math.round(v + t * (b[k] - v))).join(",")})`;
  }

  async function posterior(m, text, scored) {
    const k = Math.max(1, Math.min(64, parseInt($("#topk").value, 10) || 4));
    const methods = (m.decode_methods || []).filter((x) => x === "viterbi" || x === "mbr");
    const [post_, served, ...paths] = await Promise.all([
      post("v1/posterior", { model: m.id, input: text, top_k: k }),
      scored ? scored.then((r) => r.data[0].tokens).catch(() => null) : null,
      ...methods.map((method) => post("v1/decode", { model: m.id, input: text, method }).then((r) => [method, r.data[0]])),
    ]);
    const marg = post_.data[0].marginals;
    const decoded = Object.fromEntries(paths);
    return () => drawHeatmap(m, text, k, marg, served, decoded);
  }

  function drawHeatmap(m, text, k, marg, served, decoded) {
    const T = marg.length;
    const words = labels(m, text, served && served.length === T ? served : null).slice(0, T);
    while (words.length < T) words.push({ word: `#${words.length}`, unk: false });
    // rows: the union of the tokens' top states and the Viterbi path's states, ordered by where they peak
    const prob = marg.map((mt) => new Map(mt.states.map((st, j) => [st, mt.probs[j]])));
    const peak = new Map();
    const see = (st, t, p) => {
      const cur = peak.get(st);
      if (!cur || p > cur.p) peak.set(st, { t, p });
    };
    marg.forEach((mt, t) => mt.states.forEach((st, j) => see(st, t, mt.probs[j])));
    const vit = decoded.viterbi ? decoded.viterbi.states : null;
    const mbr = decoded.mbr ? decoded.mbr.states : null;
    if (vit) vit.forEach((st, t) => see(st, t, prob[t].get(st) ?? -1));
    const rows = [...peak.keys()].sort((a, b) => peak.get(a).t - peak.get(b).t || peak.get(b).p - peak.get(a).p || a - b);
    const rowOf = new Map(rows.map((st, i) => [st, i]));

    const colW = Math.max(38, Math.min(76, Math.floor(880 / T)));
    const rowH = rows.length > 60 ? 10 : rows.length > 30 ? 14 : 20;
    const longest = Math.max(...words.map((w) => w.word.length + (w.unk ? 6 : 0)));
    const left = 78, labelH = Math.min(170, Math.max(44, 24 + longest * 7)); // labels slant up at 38°
    const tagRows = [];
    if (decoded.viterbi && decoded.viterbi.tags) tagRows.push(["viterbi", "Viterbi tags", decoded.viterbi.tags]);
    if (decoded.mbr && decoded.mbr.tags) tagRows.push(["mbr", "MBR tags", decoded.mbr.tags]);
    const top = labelH + tagRows.length * 18 + 6;
    const W = left + T * colW + 12, H = top + rows.length * rowH + 10;
    const svgEl = $("#heatmap");
    clear(svgEl);
    svgEl.setAttribute("width", W); svgEl.setAttribute("height", H);
    svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const cx = (t) => left + t * colW + colW / 2;
    const cy = (r) => top + r * rowH + rowH / 2;
    const detail = $("#posterior-detail");
    const g = s("g", { class: "col-labels" });
    words.forEach((w, t) => {
      g.append(titled(s("text", {
        class: "col-label" + (w.unk ? " unk" : ""), "data-t": t,
        transform: `translate(${cx(t) - 4},${labelH - 6}) rotate(-38)`,
      }, w.word + (w.unk ? " ‹unk›" : "")), w.unk ? `${w.word}: not in the vocabulary (<unk>)` : w.word));
    });
    svgEl.append(g);
    tagRows.forEach(([cls, name, tags], i) => {
      const y = labelH + 14 + i * 18;
      const tg = s("g", { class: "tags " + cls });
      tg.append(s("text", { class: "row-title axis-label", x: left - 6, y, "text-anchor": "end" }, name));
      tags.forEach((tag, t) => tg.append(s("text", { class: "tag " + cls, x: cx(t), y, "text-anchor": "middle" }, tag)));
      svgEl.append(tg);
    });
    const rl = s("g", { class: "row-labels" });
    rows.forEach((st, r) => {
      if (rowH >= 12 || r % 2 === 0) {
        rl.append(s("text", { class: "row-label", x: left - 6, y: cy(r) + 4, "text-anchor": "end", "data-state": st }, `state ${st}`));
      } else {
        rl.append(s("text", { class: "row-label", x: left - 6, y: cy(r) + 4, "text-anchor": "end", "data-state": st, opacity: 0 }, `state ${st}`));
      }
    });
    svgEl.append(rl);
    const cells = s("g", { class: "cells" });
    rows.forEach((st, r) => {
      for (let t = 0; t < T; t++) {
        const p = prob[t].get(st);
        const known = p !== undefined;
        const rect = s("rect", {
          class: "cell" + (known ? "" : " missing"), x: left + t * colW, y: top + r * rowH, width: colW, height: rowH,
          fill: known ? blues(p) : null, "data-state": st, "data-t": t, "data-p": known ? p : null,
        });
        const txt = known ? `p(state ${st} | sentence) at "${words[t].word}" = ${p.toFixed(4)}`
          : `state ${st} is not among the top ${k} states of "${words[t].word}" (p < ${marg[t].probs[marg[t].probs.length - 1].toFixed(4)})`;
        titled(rect, txt);
        rect.addEventListener("mouseenter", () => {
          const on = [vit && vit[t] === st ? "on the Viterbi path" : "", mbr && mbr[t] === st ? "the MBR choice" : ""].filter(Boolean);
          detail.textContent = txt + (on.length ? " · " + on.join(", ") : "");
        });
        cells.append(rect);
      }
    });
    svgEl.append(cells);
    const line = (states, cls, dot) => {
      const pts = states.map((st, t) => `${cx(t)},${cy(rowOf.get(st))}`).join(" ");
      svgEl.append(s("polyline", { class: cls, points: pts, "data-points": states.length }));
      const dots = s("g", { class: dot });
      states.forEach((st, t) => dots.append(s("circle", { cx: cx(t), cy: cy(rowOf.get(st)), r: dot === "dot-mbr" ? 5 : 3.2 })));
      svgEl.append(dots);
    };
    if (mbr && mbr.every((st) => rowOf.has(st))) line(mbr, "path-mbr", "dot-mbr");
    if (vit) line(vit, "path-viterbi", "dot-viterbi");
    const parts = [`${T} tokens × ${rows.length} states (of ${m.num_states})`];
    if (decoded.viterbi && decoded.viterbi.logprob !== undefined) parts.push(`Viterbi log p(x, z) = ${fmt(decoded.viterbi.logprob, 3)}`);
    if (decoded.mbr && decoded.mbr.expected_correct !== undefined) parts.push(`MBR expected correct = ${fmt(decoded.mbr.expected_correct, 2)} of ${T}`);
    $("#posterior-summary").textContent = parts.join(" · ");
  }

  // -- parse (PCFG) ---------------------------------------------------------------------------------------
  /** "(S (X 1) (X 2))" -> {label, children: [..., {leaf: "1"}]} */
  function parseTree(str) {
    const toks = str.match(/\(|\)|[^\s()]+/g) || [];
    let i = 0;
    function node() {
      if (toks[i] !== "(") throw new Error(`malformed tree at token ${i}: ${str}`);
      i += 1;
      const out = { label: toks[i++], children: [] };
      while (i < toks.length && toks[i] !== ")") {
        out.children.push(toks[i] === "(" ? node() : { leaf: toks[i++] });
      }
      i += 1;
      return out;
    }
    return node();
  }

  async function unkId(m) {
    // the id the model gives unknown words, read from the MBR parse of the one-word sentence "<unk>"
    const unk = (m.preprocessing || {}).unk;
    if (!unk) return null;
    if (!state.unkIds.has(m.id)) {
      state.unkIds.set(m.id, post("v1/decode", { model: m.id, input: unk, method: "mbr" })
        .then((r) => { const leaf = (r.data[0].tree.match(/[^\s()]+(?=\))/) || [])[0]; return leaf === undefined ? null : leaf; })
        .catch(() => null));
    }
    return state.unkIds.get(m.id);
  }

  async function parse(m, text) {
    const methods = (m.decode_methods || []).filter((x) => x === "mbr" || x === "viterbi");
    const [spans, unk, ...trees] = await Promise.all([
      can(m, "posterior") ? post("v1/posterior", { model: m.id, input: text, top_k: null }).then((r) => r.data[0].spans) : [],
      unkId(m),
      ...methods.map((method) => post("v1/decode", { model: m.id, input: text, method }).then((r) => [method, r.data[0]])),
    ]);
    return () => {
      state.parse = { m, text, spans, unk, trees: Object.fromEntries(trees) };
      const sel = clear($("#tree-method"));
      for (const [method] of trees) sel.append(h("option", { value: method, text: method === "mbr" ? "MBR" : "Viterbi (labelled)" }));
      drawParse();
    };
  }

  function drawParse() {
    const { m, text, spans, unk, trees } = state.parse;
    const method = $("#tree-method").value || Object.keys(trees)[0];
    const res = trees[method];
    const root = parseTree(res.tree);
    const typed = tokenize(m, text);
    const leaves = [];
    (function collect(nd) { for (const c of nd.children) (c.leaf !== undefined ? leaves.push(c) : collect(c)); })(root);
    const n = leaves.length;
    const words = leaves.map((lf, i) => ({ word: typed.length === n ? typed[i] : `#${lf.leaf}`, unk: unk !== null && lf.leaf === unk, id: lf.leaf }));
    const colW = Math.max(56, Math.min(96, Math.floor(900 / n)));
    const levelH = 46, pad = 24;
    // layout: leaves evenly spaced; a node above the middle of its children, one level per depth
    let depthMax = 0, li = 0;
    (function place(nd, depth) {
      nd.depth = depth;
      depthMax = Math.max(depthMax, depth);
      const xs = nd.children.map((c) => (c.leaf !== undefined ? (c.x = pad + (li++) * colW + colW / 2) : place(c, depth + 1)));
      nd.x = (Math.min(...xs) + Math.max(...xs)) / 2;
      return nd.x;
    })(root, 0);
    const W = pad * 2 + n * colW, wordY = (depthMax + 1) * levelH + 30;
    const H = wordY + 16;
    const svgEl = clear($("#tree"));
    svgEl.setAttribute("width", W); svgEl.setAttribute("height", H); svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const y = (d) => 22 + d * levelH;
    const edges = s("g", { class: "edges" }), nodes = s("g", { class: "nodes" }), leafG = s("g", { class: "leaves" });
    let k = 0;
    (function drawNode(nd) {
      for (const c of nd.children) {
        if (c.leaf !== undefined) {
          edges.append(s("line", { class: "edge lex", x1: nd.x, y1: y(nd.depth) + 9, x2: c.x, y2: wordY - 16 }));
          const w = words[k++];
          leafG.append(titled(s("text", { class: "leaf" + (w.unk ? " unk" : ""), x: c.x, y: wordY, "data-id": w.id },
            w.word + (w.unk ? " ‹unk›" : "")), `token id ${w.id}${w.unk ? " (<unk>: not in the vocabulary)" : ""}`));
        } else {
          edges.append(s("line", { class: "edge", x1: nd.x, y1: y(nd.depth) + 9, x2: c.x, y2: y(c.depth) - 9 }));
          drawNode(c);
        }
      }
      const wLab = Math.max(22, nd.label.length * 8 + 10);
      nodes.append(s("g", { class: "node", "data-label": nd.label },
        s("rect", { x: nd.x - wLab / 2, y: y(nd.depth) - 9, width: wLab, height: 18, rx: 4 }),
        s("text", { x: nd.x, y: y(nd.depth) + 4 }, nd.label)));
    })(root);
    svgEl.append(edges, nodes, leafG);
    const summ = [`${n} tokens`, method === "mbr" ? `expected correct spans ${fmt(res.expected_correct, 2)}` : `log p(x, tree) = ${fmt(res.logprob, 3)}`];
    $("#parse-summary").textContent = summ.join(" · ");
    drawChart(n, words, spans, trees.mbr ? trees.mbr.spans : res.spans, colW, pad);
  }

  function drawChart(n, words, spans, treeSpans, colW, pad) {
    const svgEl = clear($("#chart"));
    const detail = $("#parse-detail");
    if (n < 2) return;
    const rowH = 24, top = 6;
    const W = pad * 2 + n * colW, H = top + (n - 1) * rowH + 30;
    svgEl.setAttribute("width", W); svgEl.setAttribute("height", H); svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const inTree = new Set((treeSpans || []).map(([a, b]) => `${a},${b}`));
    const byKey = new Map(spans.map((sp) => [`${sp.start},${sp.end}`, sp.prob]));
    const g = s("g", { class: "spans" });
    for (let w = n; w >= 2; w--) {
      for (let i = 0; i + w <= n; i++) {
        const p = byKey.get(`${i},${i + w}`) ?? 0;
        const x = pad + i * colW + (w - 1) * colW / 2, yy = top + (n - w) * rowH;
        const key = `${i},${i + w}`;
        const phrase = words.slice(i, i + w).map((x_) => x_.word).join(" ");
        const txt = `p(“${phrase}” is a constituent) = ${p.toFixed(4)}${inTree.has(key) ? " · in the MBR tree" : ""}`;
        const rect = titled(s("rect", {
          class: "span-cell" + (inTree.has(key) ? " mbr" : ""), x: x + 1, y: yy + 1, width: colW - 2, height: rowH - 2,
          fill: blues(p), "data-start": i, "data-end": i + w, "data-p": p,
        }), txt);
        rect.addEventListener("mouseenter", () => { detail.textContent = txt; });
        g.append(rect);
      }
    }
    svgEl.append(g);
    const wy = top + (n - 1) * rowH + 18;
    words.forEach((w, i) => svgEl.append(s("text", { class: "leaf" + (w.unk ? " unk" : ""), x: pad + i * colW + colW / 2, y: wy }, w.word)));
  }

  // -- embeddings -----------------------------------------------------------------------------------------
  /** Top-2 principal components of the rows of X by power iteration on X^T X (centred), with deflation. */
  function pca2(X) {
    const T = X.length, d = X[0].length;
    const mean = new Float64Array(d);
    for (const row of X) for (let j = 0; j < d; j++) mean[j] += row[j] / T;
    const C = X.map((row) => Float64Array.from(row, (v, j) => v - mean[j]));
    let total = 0;
    for (const row of C) for (const v of row) total += v * v;
    const comps = [], vars = [], coords = [];
    for (let c = 0; c < 2; c++) {
      let v = Float64Array.from({ length: d }, (_, j) => 1 + ((j * 7919 + c * 104729) % 97) / 97);
      let lambda = 0;
      for (let it = 0; it < 500; it++) {
        const u = C.map((row) => row.reduce((a, x, j) => a + x * v[j], 0));
        const w = new Float64Array(d);
        C.forEach((row, t) => { for (let j = 0; j < d; j++) w[j] += row[j] * u[t]; });
        for (const p of comps) { const dot = w.reduce((a, x, j) => a + x * p[j], 0); for (let j = 0; j < d; j++) w[j] -= dot * p[j]; }
        const norm = Math.hypot(...w);
        if (!(norm > 1e-300)) { v = new Float64Array(d); lambda = 0; break; }
        const next = w.map((x) => x / norm);
        const delta = next.reduce((a, x, j) => a + Math.abs(x - v[j]), 0);
        v = next; lambda = norm;
        if (delta < 1e-12) break;
      }
      const proj = C.map((row) => row.reduce((a, x, j) => a + x * v[j], 0));
      const big = proj.reduce((a, x) => (Math.abs(x) > Math.abs(a) ? x : a), 0);
      comps.push(v); vars.push(lambda); coords.push(big < 0 ? proj.map((x) => -x) : proj);
    }
    return { xy: coords[0].map((x, t) => [x, coords[1][t]]), explained: vars.map((l) => (total > 0 ? l / total : 0)) };
  }

  async function embeddings(m, text, scored) {
    const causal = $("#causal").checked;
    const [r, served] = await Promise.all([
      post("v1/embed", { model: m.id, input: text, causal }),
      scored ? scored.then((x) => x.data[0].tokens || null).catch(() => null) : null,
    ]);
    const e = r.data[0];
    return () => {
      const T = e.embeddings.length;
      const words = labels(m, text, served).slice(0, T);
      while (words.length < T) words.push({ word: `#${words.length}`, unk: false });
      const svgEl = clear($("#embeddings"));
      if (T < 2) { $("#embeddings-summary").textContent = "A projection needs at least two tokens."; return; }
      const { xy, explained } = pca2(e.embeddings);
      const Wd = 760, Hd = 460, pad = 50;
      const xs = xy.map((p) => p[0]), ys = xy.map((p) => p[1]);
      const span = Math.max(Math.max(...xs) - Math.min(...xs), Math.max(...ys) - Math.min(...ys), 1e-9);
      const sc = Math.min((Wd - 2 * pad) / span, (Hd - 2 * pad) / span);
      const mx = (Math.max(...xs) + Math.min(...xs)) / 2, my = (Math.max(...ys) + Math.min(...ys)) / 2;
      const px = (x) => Wd / 2 + (x - mx) * sc, py = (y) => Hd / 2 - (y - my) * sc;
      svgEl.setAttribute("width", Wd); svgEl.setAttribute("height", Hd); svgEl.setAttribute("viewBox", `0 0 ${Wd} ${Hd}`);
      svgEl.append(s("rect", { x: 0.5, y: 0.5, width: Wd - 1, height: Hd - 1, fill: "#fbfcfd", stroke: "#d9dee5" }));
      svgEl.append(s("text", { class: "axis-label", x: Wd - 8, y: Hd - 8, "text-anchor": "end" }, `PC1 (${(100 * explained[0]).toFixed(0)}% of variance) →`));
      svgEl.append(s("text", { class: "axis-label", x: 10, y: 18 }, `↑ PC2 (${(100 * explained[1]).toFixed(0)}%)`));
      svgEl.append(s("polyline", { class: "emb-path", points: xy.map(([x, y]) => `${px(x)},${py(y)}`).join(" ") }));
      const detail = $("#embeddings-detail");
      xy.forEach(([x, y], t) => {
        const c = `hsl(${Math.round(220 - 200 * t / Math.max(1, T - 1))},70%,50%)`;
        const txt = `“${words[t].word}” (position ${t}): PC1 ${x.toFixed(3)}, PC2 ${y.toFixed(3)}`;
        const pt = titled(s("circle", { class: "emb-point", cx: px(x), cy: py(y), r: 6, fill: c, "data-t": t }), txt);
        pt.addEventListener("mouseenter", () => { detail.textContent = txt; });
        svgEl.append(pt, s("text", { class: "emb-label" + (words[t].unk ? " unk" : ""), x: px(x) + 9, y: py(y) - 7 }, words[t].word));
      });
      $("#embeddings-summary").textContent = `${T} tokens · dimension ${e.dim} · ${causal ? "filtered (causal)" : "smoothed"} embeddings · PC1 + PC2 explain ${(100 * (explained[0] + explained[1])).toFixed(0)}% of the variance`;
    };
  }

  // -- sampling -------------------------------------------------------------------------------------------
  function setupSampling(m) {
    const prefix = $("#prefix");
    const tree = isTree(m);
    prefix.disabled = tree;
    if (tree) prefix.value = "";
    $("#prefix-note").textContent = tree ? `a ${m.family} samples whole sentences (no prefix)` : "";
  }

  async function sample(ev) {
    ev.preventDefault();
    const m = state.model;
    if (!m) return;
    const int = (id, lo, dflt) => Math.max(lo, parseInt($(id).value, 10) || dflt);
    const body = {
      model: m.id, n: Math.min(20, int("#n", 1, 3)), max_tokens: Math.min(200, int("#max-tokens", 1, 20)),
      seed: int("#seed", 0, 0), temperature: parseFloat($("#temperature").value) || 1, stream: true,
    };
    const prefix = $("#prefix").value.trim();
    if (prefix && !isTree(m)) body.prefix = prefix;
    const list = clear($("#samples"));
    clear($("#sample-usage"));
    const gen = bump("sampling");
    $("#sample").disabled = true;
    viewState("sampling", "loading");
    try {
      const r = await request("v1/sample", body);
      const done = await readEvents(r, "sampling", gen, (obj) => {
        if (obj.object === "sample.chunk") list.append(sampleItem(m, prefix, obj));
        else if (obj.object === "sample.usage") {
          $("#sample-usage").textContent = `${obj.usage.output_tokens} tokens sampled (prefix ${obj.usage.input_tokens} tokens)`;
        }
      });
      if (done === null) return;
      viewState("sampling", done ? "done" : "error", done ? "" : "the stream ended early");
    } catch (e) {
      if (gen === gens.sampling) viewState("sampling", "error", e.message);
    } finally {
      $("#sample").disabled = false;
    }
  }

  /** Read a server-sent-events answer of `v1/sample`, calling `onEvent` with each JSON object. Returns whether the
   *  stream ended with [DONE], or null when a newer run of `view` superseded this one (the stream is cancelled). */
  async function readEvents(r, view, gen, onEvent) {
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "", done = false;
    const handle = (event) => {
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") { done = true; continue; }
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(0, obj.error.message, obj.error.param);
        onEvent(obj);
      }
    };
    for (;;) {
      const { value, done: end } = await reader.read();
      if (gen !== gens[view]) { reader.cancel(); return null; }
      if (end) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) { handle(buf.slice(0, i)); buf = buf.slice(i + 2); }
    }
    if (buf.trim()) handle(buf);
    return done;
  }

  function sampleItem(m, prefix, obj) {
    const eos = (m.preprocessing || {}).eos;
    const li = h("li", { class: "sample", "data-index": obj.index });
    if (prefix) li.append(h("span", { class: "prefix", text: prefix + " " }));
    li.append(h("span", { class: "continuation" }, ...obj.tokens.map((t, i) =>
      h("span", { class: t === eos ? "eos" : "stok", text: (i ? " " : "") + t }))));
    if (obj.tree) li.append(h("span", { class: "tree-string", text: relabel(obj.tree, obj.tokens) }));
    return li;
  }

  /** A bracketed tree whose leaves are token ids, with the words put in (when the counts agree). */
  function relabel(tree, tokens) {
    const leaf = /\(([^\s()]+) ([^\s()]+)\)/g;
    if ((tree.match(leaf) || []).length !== tokens.length) return tree;
    let k = 0;
    return tree.replace(leaf, (_, label) => `(${label} ${tokens[k++]})`);
  }

  // -- constraints ----------------------------------------------------------------------------------------
  // The form's text -> the `constraint` object: keywords one group per line, alternatives within a group (and
  // excluded words) separated by "|", a phrase being words separated by spaces. P(C | prefix) from
  // v1/constraint, then exact constrained samples from v1/sample (same `constraint`), streamed.
  const GROUP_COLOURS = 8; // .kw.g0 .. .kw.g7 in the CSS; group i uses i mod 8
  const FIELD_NAMES = { include: "keywords", exclude: "excluded", ordered: "ordered", min_tokens: "min tokens",
    max_tokens: "max tokens", regex: "regex", suffix: "suffix", prefix: "prefix", n: "samples", seed: "seed",
    temperature: "temperature" };

  /** "stock | shares  fell" -> ["stock", "shares fell"]: the pieces between "|", spaces collapsed, empty ones dropped. */
  const alternatives = (text) => text.split("|").map((x) => x.trim().replace(/\s+/g, " ")).filter(Boolean);

  /** The form -> {spec (the constraint object), lines (the keyword line of each include group), prefix, n, seed,
   *  temperature}. Numbers are passed on as typed; the server checks them and names the field. */
  function readConstraintForm() {
    const spec = {}, lines = [];
    const groups = [];
    $("#c-include").value.split("\n").forEach((line, i) => {
      const alts = alternatives(line);
      if (alts.length) { groups.push(alts); lines.push(i + 1); }
    });
    if (groups.length) spec.include = groups;
    if ($("#c-ordered").checked) spec.ordered = true;
    const exclude = alternatives($("#c-exclude").value);
    if (exclude.length) spec.exclude = exclude;
    const num = (id) => { const v = $(id).value.trim(); return v === "" ? null : Number(v); };
    const lo = num("#c-min-tokens"), hi = num("#c-max-tokens");
    if (lo !== null) spec.min_tokens = lo;
    if (hi !== null) spec.max_tokens = hi;
    const suffix = $("#c-suffix").value.trim(), regex = $("#c-regex").value.trim();
    if (suffix) spec.suffix = suffix;
    if (regex) spec.regex = regex;
    const n = num("#c-n");
    return {
      spec, lines, prefix: $("#c-prefix").value.trim(), n: n === null ? 0 : Math.min(20, n),
      seed: num("#c-seed") ?? 0, temperature: num("#c-temperature") ?? 1,
    };
  }

  function clearFieldErrors(root) {
    for (const f of root.querySelectorAll(".c-field.invalid")) f.classList.remove("invalid");
    for (const e of root.querySelectorAll(".field-error")) e.textContent = "";
  }

  /** Show an API error next to the field its `param` names (`constraint.include`, `prefix`, `max_tokens`, ...). */
  function markField(err, lines) {
    if (!err.param) return;
    const key = (err.param.replace(/^constraint\./, "").match(/^[a-z_]+/) || [])[0];
    const field = key && $(`#constraint-form .c-field[data-field="${key}"]`);
    if (!field) return;
    field.classList.add("invalid");
    const group = key === "include" ? /include\[(\d+)\]/.exec(err.message) : null;
    const where = group && lines[+group[1]] ? ` (line ${lines[+group[1]]})` : "";
    $(".field-error", field).textContent = `${FIELD_NAMES[key] || key}${where}: ${err.message.replace(/^[\w.[\]]+: /, "")}`;
  }

  /** p = e^lp written for any lp, even below what a double holds (e^-800): "0.0123", "3.210e-7", "4.5e-348". */
  function probText(lp) {
    if (lp === null) return "0";
    const p = Math.exp(lp);
    if (p >= 1e-3) return p.toPrecision(4);
    const l10 = lp / Math.LN10, e = Math.floor(l10);
    let mant = Math.pow(10, l10 - e), exp = e;
    if (Number(mant.toFixed(3)) >= 10) { mant /= 10; exp += 1; }
    return `${mant.toFixed(3)}e${exp}`;
  }

  async function constrain(ev) {
    ev.preventDefault();
    const m = state.model;
    if (!m || !VIEWS.constraints(m)) return;
    const form = readConstraintForm();
    resetView("constraints");
    const gen = bump("constraints");
    const body = { model: m.id, constraint: form.spec };
    if (form.prefix) body.prefix = form.prefix;
    if (form.temperature !== 1) body.temperature = form.temperature;
    $("#constraint-request pre").textContent = JSON.stringify(body, null, 2);
    $("#constrain").disabled = true;
    viewState("constraints", "loading");
    try {
      const res = await post("v1/constraint", body);
      if (gen !== gens.constraints) return;
      drawConstraint(m, form, res);
      if (res.log_prob === null || form.n < 1) { viewState("constraints", "done"); return; }
      const sbody = { ...body, n: form.n, seed: form.seed, max_tokens: res.automaton.max_tokens, stream: true };
      const r = await request("v1/sample", sbody);
      if (gen !== gens.constraints) return;
      const groups = (form.spec.include || []).map((alts) => alts.map((a) => wordsOf(m, a)));
      const suffix = form.spec.suffix ? wordsOf(m, form.spec.suffix) : [];
      const list = $("#constraint-samples");
      const done = await readEvents(r, "constraints", gen, (obj) => {
        if (obj.object === "sample.chunk") list.append(constrainedItem(m, form.prefix, groups, suffix, obj));
        else if (obj.object === "sample.usage") {
          $("#constraint-usage").textContent = `${obj.usage.output_tokens} tokens sampled exactly from p(y | prefix, y satisfies C)`
            + (form.temperature !== 1 ? ` at temperature ${form.temperature}` : "") + ` · seed ${form.seed}`;
        }
      });
      if (done === null) return;
      viewState("constraints", done ? "done" : "error", done ? "" : "the stream ended early");
    } catch (e) {
      if (gen !== gens.constraints) return;
      viewState("constraints", "error", e.message);
      markField(e, form.lines);
      if (e.status === 401) status(e.message, true);
    } finally {
      $("#constrain").disabled = false;
    }
  }

  function drawConstraint(m, form, res) {
    const lp = res.log_prob, a = res.automaton;
    const window_ = `${a.min_tokens}–${a.max_tokens} tokens`;
    const cond = form.prefix ? "prefix" : "start";
    const summary = $("#constraint-summary");
    if (lp === null) {
      summary.replaceChildren(`P(C | ${cond}) = `, h("b", { id: "constraint-prob", "data-log-prob": "null", text: "0" }),
        h("span", { class: "note", text: ` · no continuation of ${window_} (with <eos>) satisfies the constraint: nothing to sample` }));
    } else {
      summary.replaceChildren(`P(C | ${cond}) = `, h("b", { id: "constraint-prob", "data-log-prob": lp, text: probText(lp) }),
        " · log P = ", h("b", { id: "constraint-logprob", text: fmt(lp, 4) }), ` nats (${fmt(lp / Math.LN10, 2)} in log10)`,
        h("span", { class: "note", text: ` · the probability that a continuation ends (<eos>) within ${window_} and satisfies C` }));
    }
    drawScale(lp);
    const parts = [`automaton: ${a.states} state${a.states === 1 ? "" : "s"}`, `${a.edges} edges`, `${a.classes} word classes`];
    const built = [["aho_corasick_nodes", "keyphrase-matcher nodes"], ["regex_states", "regex states"],
      ["product_states", "product states before minimisation"]].filter(([k]) => a[k]).map(([k, what]) => `${a[k]} ${what}`);
    $("#constraint-automaton").replaceChildren(h("span", { id: "constraint-states", "data-states": a.states, "data-edges": a.edges,
      text: parts.join(" · ") }), built.length ? ` (from ${built.join(", ")})` : "", ` · length window ${window_}, counting <eos>`);
    drawLegend(form);
  }

  /** A log10 axis from a decade below P(C) to 1, with P(C) marked (nothing for probability 0). */
  function drawScale(lp) {
    const svgEl = clear($("#constraint-scale"));
    if (lp === null) { svgEl.setAttribute("width", 0); svgEl.setAttribute("height", 0); return; }
    const l10 = lp / Math.LN10;
    const lo = Math.min(-3, Math.floor(l10) - 1);
    const step = Math.max(1, Math.ceil(-lo / 8));
    const W = 620, H = 44, left = 14, right = W - 30;
    const x = (v) => left + (v - lo) / -lo * (right - left);
    svgEl.setAttribute("width", W); svgEl.setAttribute("height", H); svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svgEl.append(s("rect", { class: "scale-track", x: left, y: 10, width: right - left, height: 8, rx: 4 }));
    svgEl.append(titled(s("rect", { class: "scale-bar", x: left, y: 10, width: Math.max(2, x(Math.min(0, l10)) - left), height: 8, rx: 4 }),
      `log10 P(C) = ${l10.toFixed(3)}`));
    for (let v = 0; v >= lo; v -= step) {
      svgEl.append(s("line", { class: "scale-tick", x1: x(v), x2: x(v), y1: 20, y2: 25 }));
      svgEl.append(s("text", { class: "axis-label", x: x(v), y: 38, "text-anchor": "middle" }, v === 0 ? "1" : `1e${v}`));
    }
    svgEl.append(s("circle", { class: "scale-mark", cx: x(Math.min(0, l10)), cy: 14, r: 6 }));
  }

  function drawLegend(form) {
    const box = clear($("#constraint-legend"));
    const groups = form.spec.include || [];
    groups.forEach((alts, g) => {
      if (g) box.append(h("span", { class: "c-join", text: form.spec.ordered ? "then" : "and" }));
      box.append(h("span", { class: `kw g${g % GROUP_COLOURS}`, "data-group": g, title: `group ${g + 1}: one of these must appear` },
        alts.join(" | ")));
    });
    if (form.spec.exclude) box.append(h("span", { class: "c-join", text: "never" }), h("span", { class: "excl", text: form.spec.exclude.join(" | ") }));
    if (form.spec.suffix) box.append(h("span", { class: "c-join", text: "ends with" }), h("span", { class: "sfx-key", text: form.spec.suffix }));
    if (form.spec.regex) box.append(h("span", { class: "c-join", text: "matches" }), h("code", { text: form.spec.regex }));
  }

  /** Where the keyword groups occur in `words`: [{start, end, groups}] left to right, overlapping occurrences
   *  merged into one span that names every group occurring inside it. O(len(words) x total alternative length). */
  function keywordSpans(words, groups) {
    const hits = [];
    groups.forEach((alts, g) => alts.forEach((alt) => {
      for (let i = 0; i + alt.length <= words.length; i++) {
        if (alt.length && alt.every((w, k) => words[i + k] === w)) hits.push([i, i + alt.length, g]);
      }
    }));
    hits.sort((x, y) => x[0] - y[0] || y[1] - x[1]);
    const spans = [];
    for (const [a, b] of hits) {
      const last = spans[spans.length - 1];
      if (last && a < last.end) last.end = Math.max(last.end, b);
      else spans.push({ start: a, end: b, groups: new Set() });
    }
    for (const [a, b, g] of hits) spans.find((sp) => a >= sp.start && b <= sp.end).groups.add(g);
    return spans;
  }

  function constrainedItem(m, prefix, groups, suffix, obj) {
    const eos = (m.preprocessing || {}).eos;
    const toks = obj.tokens;
    const content = toks.length && toks[toks.length - 1] === eos ? toks.slice(0, -1) : toks.slice();
    const spans = keywordSpans(content, groups);
    const sfxFrom = suffix.length && suffix.every((w, k) => content[content.length - suffix.length + k] === w)
      ? content.length - suffix.length : content.length;
    const tok = (i) => h("span", { class: "stok" + (i >= sfxFrom ? " in-suffix" : ""), text: content[i] });
    const cont = h("span", { class: "continuation" });
    const items = [];
    for (let i = 0; i < content.length;) {
      const sp = spans.find((x) => x.start === i);
      if (!sp) { items.push(tok(i)); i += 1; continue; }
      const gs = [...sp.groups].sort((x, y) => x - y);
      const mark = h("mark", { class: `kw g${gs[0] % GROUP_COLOURS}`, "data-groups": gs.join(" "),
        title: gs.map((g) => `group ${g + 1}`).join(", ") });
      for (let k = sp.start; k < sp.end; k++) { if (k > sp.start) mark.append(" "); mark.append(tok(k)); }
      items.push(mark);
      i = sp.end;
    }
    if (content.length < toks.length) items.push(h("span", { class: "eos", text: toks[toks.length - 1] }));
    items.forEach((x, i) => { if (i) cont.append(" "); cont.append(x); });
    const li = h("li", { class: "sample", "data-index": obj.index });
    if (prefix) li.append(h("span", { class: "prefix", text: prefix + " " }));
    li.append(cont);
    return li;
  }

  // -- model card -----------------------------------------------------------------------------------------
  function flatten(obj, prefix = "", out = []) {
    for (const [k, v] of Object.entries(obj || {})) {
      const key = prefix ? `${prefix}.${k}` : k;
      if (v === null || v === undefined) continue;
      if (Array.isArray(v)) {
        const scalar = v.every((x) => x === null || typeof x !== "object");
        out.push([key, scalar && v.length <= 12 ? v.map((x) => (typeof x === "number" ? +x.toPrecision(6) : x)).join(", ") : `[${v.length} ${scalar ? "values" : "entries"}]`]);
      } else if (typeof v === "object") flatten(v, key, out);
      else out.push([key, typeof v === "number" ? +v.toPrecision(6) : String(v)]);
    }
    return out;
  }

  function table(el, rows) {
    clear(el);
    for (const [k, v, cls] of rows) el.append(h("tr", { class: cls || null, "data-key": k }, h("th", { text: k }), h("td", { text: String(v) })));
  }

  async function loadCard(m) {
    const gen = bump("card");
    viewState("card", "loading");
    let d;
    try {
      d = await getJSON(modelPath(m));
    } catch (e) {
      if (gen === gens.card) viewState("card", "error", e.message);
      return;
    }
    if (gen !== gens.card) return;
    const known = new Set(["id", "object", "family", "vocab_size", "operations", "decode_methods", "default_method",
      "backend", "backend_notes", "preprocessing", "content_hash", "created", "provenance"]);
    const rows = [["name", d.id], ["family", d.family], ["vocabulary", `${d.vocab_size} tokens`]];
    for (const [k, v] of Object.entries(d)) {
      if (known.has(k) || v === null || v === undefined) continue;
      rows.push([k, Array.isArray(v) ? v.join(", ") : typeof v === "object" ? JSON.stringify(v) : v]);
    }
    rows.push(["operations", (d.operations || []).join(", ")]);
    if ((d.decode_methods || []).length) rows.push(["decode methods", `${d.decode_methods.join(", ")} (default ${d.default_method})`]);
    rows.push(["backend", Object.entries(d.backend || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "torch"]);
    rows.push(["preprocessing", Object.entries(d.preprocessing || {}).map(([k, v]) => `${k}=${v}`).join(", ")]);
    rows.push(["content hash", (d.content_hash || "").slice(0, 16) + "…"], ["created", (d.provenance || {}).created || "–"]);
    table($("#card-model"), rows);
    // provenance: perplexity first, then what else training recorded; its settings folded into one row
    const prov = flatten(d.provenance || {}).filter(([k]) => k !== "created");
    const isPpl = ([k]) => /ppl|perplexity/i.test(k);
    const isSetting = ([k]) => k.startsWith("settings.");
    const settings = prov.filter((r) => isSetting(r) && !isPpl(r)).map(([k, v]) => `${k.slice(9)}=${v}`);
    const trows = [...prov.filter(isPpl).map(([k, v]) => [k, v, "highlight perplexity"]),
      ...prov.filter((r) => !isPpl(r) && !isSetting(r))];
    const data = prov.find(([k]) => k === "settings.data");
    if (data && !prov.some(([k]) => k === "data")) trows.splice(prov.filter(isPpl).length, 0, ["data", data[1], "highlight"]);
    if (settings.length) trows.push(["settings", settings.join(", ")]);
    table($("#card-training"), trows.length ? trows : [["provenance", "none recorded"]]);
    viewState("card", "done");
    loadCurve(m, gen);
  }

  async function loadCurve(m, gen) {
    const img = $("#curve"), note = $("#curve-note");
    if (img.src) URL.revokeObjectURL(img.src);
    img.hidden = true;
    img.removeAttribute("src");
    note.textContent = "";
    try {
      const blob = await (await request(modelPath(m) + "/curve.png")).blob();
      if (gen !== gens.card) return;
      img.src = URL.createObjectURL(blob);
      img.hidden = false;
    } catch (e) {
      if (gen !== gens.card) return;
      note.textContent = e.status === 404 ? "This artifact carries no training curve." : e.message;
    }
  }

  // -- API key --------------------------------------------------------------------------------------------
  function showKeyState() {
    $("#key-state").textContent = localStorage.getItem(KEY_STORE) ? "key saved" : "no key";
  }

  // -- wiring ---------------------------------------------------------------------------------------------
  function init() {
    $("#key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("#api-key").value.trim();
      if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
      $("#api-key").value = "";
      showKeyState();
      loadModels();
    });
    $("#key-clear").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); showKeyState(); });
    $("#model").addEventListener("change", (ev) => selectModel(ev.target.value));
    $("#text-form").addEventListener("submit", (ev) => { ev.preventDefault(); analyze(); });
    for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => showView(b.dataset.view));
    const rerun = (view, fn) => () => {
      const m = state.model;
      if (!m || !state.text || !VIEWS[view](m)) return;
      resetView(view);
      const scored = can(m, "score") ? post("v1/score", { model: m.id, input: state.text, token_logprobs: true }) : null;
      if (scored) scored.catch(() => {});
      runView(view, () => fn(m, state.text, scored));
    };
    $("#topk").addEventListener("change", rerun("posterior", posterior));
    $("#causal").addEventListener("change", rerun("embeddings", embeddings));
    $("#tree-method").addEventListener("change", () => { if (state.parse) drawParse(); });
    $("#prefix").addEventListener("input", () => { $("#prefix").dataset.edited = "1"; });
    $("#sample-form").addEventListener("submit", sample);
    $("#constraint-form").addEventListener("submit", constrain);
    $("#constraint-form").addEventListener("input", (ev) => {
      const field = ev.target.closest(".c-field");
      if (field) { field.classList.remove("invalid"); $(".field-error", field).textContent = ""; }
    });
    $("#text").value = localStorage.getItem(TEXT_STORE) || "";
    showKeyState();
    showView("surprisal");
    loadModels();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
