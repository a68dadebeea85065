# syntax=docker/dockerfile:1
# Build stage: the release binary, and the demo origin the compose file puts
# behind the proxy.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
RUN cargo build --release --locked --bin idemgate --example origin

# Runtime stage: a small image, run as an unprivileged user.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/idemgate --create-home idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY --from=build /src/target/release/examples/origin /usr/local/bin/idemgate-demo-origin
USER idemgate
WORKDIR /var/lib/idemgate
EXPOSE 8080 8081 9090
ENTRYPOINT ["idemgate"]
CMD ["serve"]
