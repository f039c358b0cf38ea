# PostgreSQL with pgvector and RUM (recall's full-text index), from Debian's packages. Debian 12
# ships no pgvector binary, so scripts/build-pgvector.sh builds the newer suites' source package,
# as on a host. BASE_IMAGE is any Debian 12 image whose apt reaches an archive
# (scripts/docker-images.sh makes one without a registry). Build context: the repository.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG PG_MAJOR=15
COPY scripts/env.sh scripts/debian.sh scripts/build-pgvector.sh /opt/mnemo/scripts/
RUN set -eux; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update; \
    apt-get install -y --no-install-recommends postgresql-common; \
    sed -ri 's/^#?\s*create_main_cluster\s*=.*/create_main_cluster = false/' /etc/postgresql-common/createcluster.conf; \
    apt-get install -y --no-install-recommends "postgresql-$PG_MAJOR" "postgresql-$PG_MAJOR-rum"; \
    bash /opt/mnemo/scripts/build-pgvector.sh "$PG_MAJOR"; \
    apt-get purge -y --auto-remove "postgresql-server-dev-$PG_MAJOR" dpkg-dev build-essential distro-info-data; \
    apt-get clean; rm -rf /var/lib/apt/lists/* /opt/mnemo; \
    install -d -o postgres -g postgres -m 2775 /var/run/postgresql /var/lib/postgresql/data
COPY docker/postgres-entrypoint.sh /usr/local/bin/
ENV PATH=/usr/lib/postgresql/$PG_MAJOR/bin:$PATH PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
# A fast shutdown: the default (smart) would wait for every client to leave.
STOPSIGNAL SIGINT
ENTRYPOINT ["postgres-entrypoint.sh"]
