# syntax=docker/dockerfile:1
# Build stage: the release binary, and the demo origin the compose file puts
# behind the proxy (a bin of the crate, so no dev-dependency is compiled).
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Cargo loads every workspace member's manifest (bench/, campaign/) even to
# build one package, and --locked checks the lock file against all of them.
COPY Cargo.toml Cargo.lock build.rs ./
COPY bench ./bench
COPY campaign ./campaign
COPY vendor ./vendor
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
# The reference pages of docs/ are built into the binary (/docs/{page}).
COPY docs ./docs
# A pre-release names its commit in `idemgate --version`; the build context
# has no .git: `docker build --build-arg IDEMGATE_COMMIT=$(git rev-parse HEAD) .`
ARG IDEMGATE_COMMIT=
RUN cargo build --release --locked --bin idemgate --bin idemgate-demo-origin

# Runtime stage: a small image, run as an unprivileged user. The SQLite store
# (the default DATABASE_URL, sqlite://idemgate.db) lands in the working
# directory, /var/lib/idemgate: mount a volume there to keep it.
FROM debian:bookworm-slim
# The release, as Cargo.toml, the client packages and CHANGELOG.md name it.
LABEL org.opencontainers.image.title="idemgate" \
      org.opencontainers.image.version="0.4.0-dev" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/idemgate --create-home idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY --from=build /src/target/release/idemgate-demo-origin /usr/local/bin/idemgate-demo-origin
USER idemgate
WORKDIR /var/lib/idemgate
EXPOSE 8080 8081 9090
ENTRYPOINT ["idemgate"]
CMD ["serve"]
