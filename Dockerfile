# syntax=docker/dockerfile:1
# Build stage: the release binary.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
RUN cargo build --release --locked --bin idemgate

# Runtime stage: a small image, run as an unprivileged user.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/idemgate --create-home idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
USER idemgate
WORKDIR /var/lib/idemgate
EXPOSE 8080
ENTRYPOINT ["idemgate"]
CMD ["serve"]
