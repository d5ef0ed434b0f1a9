# One image for every fedkey service (server, device fleet, keyboard); the command picks the role.
# CPU-only torch: pass --build-arg PIP_EXTRA_INDEX_URL=<the PyTorch CPU wheel index> to avoid the
# multi-GB CUDA build that the default index serves for torch on Linux.
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY requirements.txt constraints.txt ./
RUN pip install -r requirements.txt -c constraints.txt
COPY . .
RUN pip install --no-deps -e .

# The run directory: database, checkpoints, metrics, exports.
VOLUME ["/data"]
EXPOSE 8000 8080
CMD ["fedkey", "--help"]
