# The runtime stage of ../Dockerfile, from binaries built on the host (scripts/docker-images.sh
# stages them with the model as the build context), for machines that cannot pull the Rust image.
# Keep the two alike.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY mnemo-server mnemo-worker mnemo-runbook /usr/local/bin/
COPY models /opt/mnemo/models
ENV MNEMO_LISTEN=0.0.0.0:8080 MNEMO_WORKER_LISTEN=0.0.0.0:9464 MNEMO_LOCAL_MODEL_DIR=/opt/mnemo/models/all-MiniLM-L6-v2
# Nothing mnemo runs needs root: a user of its own, with no home and no login.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin mnemo
USER 10001
EXPOSE 8080 9464
CMD ["mnemo-server"]
