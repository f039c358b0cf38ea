# PostgreSQL with pgvector (from the base image) and RUM, which recall's full-text index needs.
FROM pgvector/pgvector:pg16
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-16-rum && rm -rf /var/lib/apt/lists/*
