# One image for every mnemo binary. Untested here (no Docker engine on the build machines);
# the local scripts are the supported path.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bins

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/mnemo-server /src/target/release/mnemo-runbook /usr/local/bin/
ENV MNEMO_LISTEN=0.0.0.0:8080
EXPOSE 8080
CMD ["mnemo-server"]
