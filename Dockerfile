# CPU image of the logprob scoring service.
# Build: docker build -t logprob-service .
# Ports: 50051 (gRPC API + health), 9464 (Prometheus /metrics).
# The build steps are the README's (scripts/install-deps.sh, scripts/build.sh),
# so what CI tests is what the image runs.
FROM debian:bookworm AS build
WORKDIR /src
COPY . .
RUN bash scripts/install-deps.sh && bash scripts/build.sh

FROM debian:bookworm-slim
COPY scripts/install-deps.sh /tmp/install-deps.sh
RUN bash /tmp/install-deps.sh && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh \
    && useradd --system --uid 10001 logprob
COPY --from=build /src/build/bin/logprob-server /src/build/bin/logprob-worker /src/build/bin/logprob-client /usr/local/bin/
USER logprob
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s \
  CMD ["logprob-client", "health", "--server", "127.0.0.1:50051"]
ENTRYPOINT ["logprob-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
CMD ["--workers", "2", "--backend", "cpu"]
