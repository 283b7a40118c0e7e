"""Family name -> implementation. Add a family by importing its class here."""

from __future__ import annotations

from latentlm.models.base import Family
from latentlm.models.errors import ArtifactError


def _families() -> dict[str, type[Family]]:
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.dense_pcfg import DensePCFG
    from latentlm.models.hmm import DenseHMM
    from latentlm.models.lds import LDS
    from latentlm.models.ngram import NGramLM
    from latentlm.models.pcfg import RankPCFG
    from latentlm.models.rank_hmm import RankHMM
    from latentlm.models.tagging_hmm import TaggingHMM

    fams: list[type[Family]] = [DenseHMM, BlockedHMM, RankHMM, LDS, TaggingHMM, DensePCFG, RankPCFG, NGramLM]
    return {f.family: f for f in fams}


def get_family(name: str) -> type[Family]:
    fams = _families()
    if name not in fams:
        raise ArtifactError(f"unknown model family {name!r} (known: {', '.join(sorted(fams))})", param="family")
    return fams[name]


def family_names() -> list[str]:
    return sorted(_families())
