# syntax=docker/dockerfile:1
# Images of the logprob scoring service (server, worker and client binaries).
#
#   docker build -t logprob-service:cpu .                    # target cpu (the default: last stage)
#   docker build --target gpu -t logprob-service:gpu .       # CUDA runtime, NVIDIA container runtime
#   docker build --build-arg RUN_TESTS=1 ...                 # also run ctest in the build stage
#
# Ports:
#   50051  gRPC API (logprob.v1) + grpc.health.v1 + reflection   (--listen)
#   9464   Prometheus /metrics, plain HTTP                       (--metrics-listen)
#   50052  worker control plane, cluster mode only               (--control-listen 0.0.0.0:50052)
#
# The build stages run the README's setup script unchanged (scripts/install-deps.sh,
# then scripts/build.sh), so the image runs what CI tests. The runtime stages do not
# get the -dev packages: scripts/runtime-packages.sh lists the Debian packages that
# ship the libraries the binaries load (ldd) and only those are installed.
# Everything is Debian 12 (bookworm), the distribution install-deps.sh names its
# packages for; the GPU stages add CUDA from NVIDIA's Debian 12 repository rather
# than starting FROM nvidia/cuda (published for Ubuntu/UBI, not Debian), so the
# gRPC/protobuf/Gloo/oneDNN libraries are the same in both images.

ARG DEBIAN_RELEASE=bookworm
# NVIDIA's package suffix (cuda-toolkit-13-0, cuda-cudart-13-0, ...) and repository.
ARG CUDA_VERSION=13-0
ARG CUDA_REPO=https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64

########################################################################## CPU build
FROM debian:${DEBIAN_RELEASE} AS build-cpu
ARG RUN_TESTS=0
WORKDIR /src
COPY . .
RUN bash scripts/install-deps.sh \
 && bash scripts/build.sh \
 && if [ "$RUN_TESTS" = 1 ]; then (cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600); fi \
 && bash scripts/runtime-packages.sh build/bin/logprob-server build/bin/logprob-worker build/bin/logprob-client \
      > /runtime-packages.txt \
 && install -D -m 0755 -t /out/bin build/bin/logprob-server build/bin/logprob-worker build/bin/logprob-client

########################################################################## GPU build
FROM debian:${DEBIAN_RELEASE} AS cuda-devel
ARG CUDA_VERSION
ARG CUDA_REPO
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates curl \
 && curl -fsSL "${CUDA_REPO}/cuda-keyring_1.1-1_all.deb" -o /tmp/cuda-keyring.deb \
 && dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "cuda-toolkit-${CUDA_VERSION}" \
 && rm -rf /var/lib/apt/lists/*
# CMake's check_language(CUDA) finds nvcc here and turns the CUDA backend on.
ENV PATH=/usr/local/cuda/bin:${PATH} \
    CUDACXX=/usr/local/cuda/bin/nvcc

FROM cuda-devel AS build-gpu
ARG RUN_TESTS=0
WORKDIR /src
COPY . .
RUN bash scripts/install-deps.sh \
 && bash scripts/build.sh \
 && if [ "$RUN_TESTS" = 1 ]; then (cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600); fi \
 && bash scripts/runtime-packages.sh build/bin/logprob-server build/bin/logprob-worker build/bin/logprob-client \
      > /runtime-packages.txt \
 && install -D -m 0755 -t /out/bin build/bin/logprob-server build/bin/logprob-worker build/bin/logprob-client

########################################################################## GPU runtime
FROM debian:${DEBIAN_RELEASE}-slim AS gpu
ARG CUDA_REPO
COPY --from=build-gpu /runtime-packages.txt /tmp/runtime-packages.txt
# NVIDIA's repository is needed here too: the CUDA runtime libraries in the list
# (cuda-cudart-*, libcublas-*, ...) come from it. The driver (libcuda) is not
# installed: the NVIDIA container runtime mounts the host's.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates curl \
 && curl -fsSL "${CUDA_REPO}/cuda-keyring_1.1-1_all.deb" -o /tmp/cuda-keyring.deb \
 && dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb \
 && apt-get update -qq \
 && xargs -a /tmp/runtime-packages.txt env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
 && apt-get purge -y -qq curl && apt-get autoremove -y -qq \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin logprob
COPY --from=build-gpu /out/bin/ /usr/local/bin/
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/usr/local/cuda/lib64
USER 10001:10001
EXPOSE 50051 9464 50052
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=4 \
  CMD ["logprob-client", "health", "--server", "127.0.0.1:50051"]
ENTRYPOINT ["logprob-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
CMD ["--workers", "1"]

########################################################################## CPU runtime (default target: keep it last)
FROM debian:${DEBIAN_RELEASE}-slim AS cpu
COPY --from=build-cpu /runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update -qq \
 && xargs -a /tmp/runtime-packages.txt env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin logprob
COPY --from=build-cpu /out/bin/ /usr/local/bin/
USER 10001:10001
EXPOSE 50051 9464 50052
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["logprob-client", "health", "--server", "127.0.0.1:50051"]
ENTRYPOINT ["logprob-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
CMD ["--workers", "2", "--backend", "cpu"]
