# One image for every mnemo binary, with the local embedding model, built from source. Without a
# registry, scripts/docker-images.sh makes the same image from host-built binaries instead
# (docker/runtime.Dockerfile); scripts/compose-test.sh runs the stack on that one.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN bash scripts/fetch-model.sh && cargo build --release --locked --bins

FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/mnemo-server /src/target/release/mnemo-worker /src/target/release/mnemo-runbook /usr/local/bin/
COPY --from=build /src/models /opt/mnemo/models
ENV MNEMO_LISTEN=0.0.0.0:8080 MNEMO_WORKER_LISTEN=0.0.0.0:9464 MNEMO_LOCAL_MODEL_DIR=/opt/mnemo/models/all-MiniLM-L6-v2
# Nothing mnemo runs needs root: a user of its own, with no home and no login.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin mnemo
USER 10001
EXPOSE 8080 9464
CMD ["mnemo-server"]
