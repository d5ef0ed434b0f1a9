# One image for every fedkey service (server, device fleet, keyboard); the command picks the role.
# CPU-only torch: pass --build-arg PIP_EXTRA_INDEX_URL=<the PyTorch CPU wheel index> to avoid the
# multi-GB CUDA build that the default index serves for torch on Linux.
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=""
# MALLOC_ARENA_MAX=2: glibc keeps at most two malloc arenas, so a long-running server's memory
# does not creep up with fragmented per-thread arenas (fedkey.runners.processes.SERVER_ENV, README).
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2

# openssl: the compose file's tls service makes the services' self-signed certificate with it.
RUN apt-get update && apt-get install -y --no-install-recommends openssl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# The runtime dependencies alone (pyproject.toml's [project] dependencies, not the dev group), at
# the versions constraints.txt pins; a layer of its own, rebuilt only when those two files change.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/runtime.txt \
    && pip install -r /tmp/runtime.txt -c constraints.txt \
    && rm /tmp/runtime.txt
COPY . .
RUN pip install --no-deps -e .

# The services run as an unprivileged user, who owns the run directory (a named volume takes the
# ownership of /data from the image when it is first created) and nothing else of the image.
RUN useradd --create-home --uid 10001 fedkey && mkdir -p /data && chown fedkey:fedkey /data
USER fedkey

# The run directory: database, checkpoints, metrics, exports.
VOLUME ["/data"]
EXPOSE 8000 8080
CMD ["fedkey", "--help"]
