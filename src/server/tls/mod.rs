//! The binary's connections out, to an upstream: the proxy's to the server
//! it guards, and the OTLP exporter's to its collector. Plain TCP for
//! `http://`, TLS (rustls) for `https://`, with the upstream's certificate
//! always checked — against the system's roots, or exactly the certificates
//! of `--upstream-ca-file` — and the connect timeout bounding the TCP
//! connect and the TLS handshake together. Under TLS or not, each
//! connection's TCP stream is a [`TcpIo`], which learns of the upstream's
//! close at once.
//!
//! The connections in, TLS on idemgate's own listeners, are [`listen`].

use std::error::Error as StdError;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tower::Service;

pub mod listen;
pub mod tcp;

pub use listen::{Listener, log_tls};

use tcp::{TcpConnector, TcpIo};

/// Where the upstream's certificate is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust<'a> {
    /// The system's roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` are honoured), or
    /// Mozilla's roots bundled in the binary on a system that has none.
    System,
    /// Exactly the certificates of this PEM file: the CA of a private
    /// network, or the upstream's own self-signed certificate.
    CaFile(&'a Path),
}

/// The connector for an upstream, `https` or not.
///
/// # Errors
/// A CA file that cannot be read, holds no certificate or a malformed one;
/// the message names the file.
pub fn connector(
    https: bool,
    trust: Trust<'_>,
    connect_timeout: Duration,
) -> Result<Connector, String> {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    // The scheme is the TLS layer's to judge: it wraps https in TLS and
    // passes http through.
    tcp.enforce_http(false);
    let roots = if https {
        roots(trust)?
    } else {
        // Never used: an http:// upstream makes no TLS connection.
        RootCertStore::empty()
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up failed: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(TcpConnector::new(tcp));
    Ok(Connector {
        inner: tls,
        timeout: connect_timeout,
    })
}

/// The roots `trust` names.
fn roots(trust: Trust<'_>) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    match trust {
        Trust::CaFile(path) => {
            let shown = path.display();
            let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
            let mut found = 0usize;
            for cert in CertificateDer::pem_slice_iter(&bytes) {
                let cert = cert.map_err(|e| format!("{shown} is not a PEM file: {e}"))?;
                store
                    .add(cert)
                    .map_err(|e| format!("{shown} holds a certificate that cannot be used: {e}"))?;
                found += 1;
            }
            if found == 0 {
                return Err(format!(
                    "{shown} holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)"
                ));
            }
        }
        Trust::System => {
            let loaded = rustls_native_certs::load_native_certs();
            for e in &loaded.errors {
                tracing::warn!(error = %e, "a system certificate could not be loaded");
            }
            let (added, _ignored) = store.add_parsable_certificates(loaded.certs);
            if added == 0 {
                tracing::warn!(
                    "the system has no trusted root certificates: the upstream's certificate is \
                     checked against the Mozilla roots built into idemgate (set \
                     IDEMGATE_UPSTREAM_CA_FILE to trust a CA of your own)"
                );
                store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            }
        }
    }
    Ok(store)
}

/// Makes connections to the upstream: TCP, then TLS for `https`, the whole
/// connect ending at `timeout` (`HttpConnector`'s own timeout covers the TCP
/// connect only).
#[derive(Debug, Clone)]
pub struct Connector {
    inner: HttpsConnector<TcpConnector>,
    timeout: Duration,
}

type BoxError = Box<dyn StdError + Send + Sync>;

impl Service<Uri> for Connector {
    type Response = MaybeHttpsStream<TokioIo<TcpIo>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected,
                Err(_) => Err(format!(
                    "no connection within the connect timeout ({} s)",
                    timeout.as_secs()
                )
                .into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = roots(Trust::CaFile(&empty)).unwrap_err();
        assert!(
            e.contains("empty.pem") && e.contains("no certificate"),
            "{e}"
        );

        let missing = dir.path().join("missing.pem");
        let e = roots(Trust::CaFile(&missing)).unwrap_err();
        assert!(
            e.contains("cannot read") && e.contains("missing.pem"),
            "{e}"
        );

        let garbled = dir.path().join("garbled.pem");
        std::fs::write(
            &garbled,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let e = roots(Trust::CaFile(&garbled)).unwrap_err();
        assert!(e.contains("garbled.pem"), "{e}");
    }
}
