//! TLS on idemgate's own listeners (`IDEMGATE_TLS_CERT`, `IDEMGATE_TLS_KEY`,
//! `IDEMGATE_TLS_CLIENT_CA`): `serve`'s listener and the proxy's two.
//!
//! The certificate and its key are read at start (a file that cannot be
//! used refuses the start, naming its setting) and again whenever either
//! file changes: each handshake first compares the two files' modification
//! time, size and inode with those of the pair it serves (two `stat`s, no
//! read), and only a change reads them. A rotated pair is served from the
//! next handshake on; connections already open keep theirs. A new pair that
//! cannot be used — half written, not PEM, a key that is not the
//! certificate's — is refused with a WARN naming the setting, and the pair
//! already served stays; the files are tried again when they change again
//! (the key written after its certificate, say).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::server::config::{ConfigError, TlsArgs};

/// The TLS side of a listener: cheap to clone, one per listener or shared.
#[derive(Clone)]
pub struct Listener {
    acceptor: TlsAcceptor,
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

impl Listener {
    /// The listeners' TLS of `args`, or `None` when no certificate is set.
    ///
    /// # Errors
    /// Only one of the certificate and the key set, a client CA without
    /// them, a file that cannot be read or used, a key that is not the
    /// certificate's: each names its setting.
    pub fn from_args(args: &TlsArgs) -> Result<Option<Listener>, ConfigError> {
        args.validate()?;
        let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
            return Ok(None);
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let resolver = Reloading::new(cert.clone(), key.clone(), provider.clone())?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError {
                setting: "tls_cert",
                problem: format!("TLS set-up failed: {e}"),
            })?;
        let builder = match &args.tls_client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = client_roots(ca)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| ConfigError {
                            setting: "tls_client_ca",
                            problem: format!(
                                "{}: cannot verify clients with it: {e}",
                                ca.display()
                            ),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(Arc::new(resolver));
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(Listener {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        }))
    }

    /// The server's side of the handshake on `stream`.
    ///
    /// # Errors
    /// The handshake failed: the client does not trust the certificate, sent
    /// no client certificate where one is required, speaks no TLS.
    pub async fn accept(&self, stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.acceptor.accept(stream).await
    }
}

/// The client CAs of `IDEMGATE_TLS_CLIENT_CA`.
fn client_roots(path: &Path) -> Result<RootCertStore, ConfigError> {
    let refuse = |problem: String| ConfigError {
        setting: "tls_client_ca",
        problem,
    };
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| refuse(format!("cannot read {shown}: {e}")))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        let cert = cert.map_err(|e| refuse(format!("{shown} is not a PEM file: {e}")))?;
        roots.add(cert).map_err(|e| {
            refuse(format!(
                "{shown} holds a certificate that cannot be used: {e}"
            ))
        })?;
    }
    if roots.is_empty() {
        return Err(refuse(format!(
            "{shown} holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)"
        )));
    }
    Ok(roots)
}

/// What a file looked like when it was last looked at: changed when any
/// differs.
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len(), inode(&meta)))
}

/// The file's inode: a rename onto the path changes it even when the time
/// and size do not.
#[cfg(unix)]
fn inode(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::ino(meta)
}

#[cfg(not(unix))]
fn inode(_meta: &std::fs::Metadata) -> u64 {
    0
}

/// A file modified this recently is read and compared on every handshake,
/// not only when its stamp changes: the kernel stamps a write with a clock
/// that ticks every few milliseconds, so two writes of the same length in
/// one tick leave the same stamp.
const SETTLING: Duration = Duration::from_secs(2);

fn settling(stamp: &Stamp) -> bool {
    stamp.is_some_and(|(modified, _, _)| {
        SystemTime::now()
            .duration_since(modified)
            .map_or(true, |age| age < SETTLING)
    })
}

/// The certificate resolver that reads its files again when they change.
struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: Mutex<Current>,
}

struct Current {
    served: Arc<CertifiedKey>,
    /// The files as last looked at (read or refused).
    seen: (Stamp, Stamp),
    /// Their contents then (`None`: unreadable).
    read: (Option<Vec<u8>>, Option<Vec<u8>>),
}

impl fmt::Debug for Reloading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloading")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Reloading {
    fn new(
        cert: PathBuf,
        key: PathBuf,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, ConfigError> {
        let seen = (stamp(&cert), stamp(&key));
        let read = (std::fs::read(&cert).ok(), std::fs::read(&key).ok());
        let served = Arc::new(load(&cert, &key, &provider)?);
        Ok(Reloading {
            cert,
            key,
            provider,
            current: Mutex::new(Current { served, seen, read }),
        })
    }

    /// The pair to serve now: the files read again first if they changed.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = (stamp(&self.cert), stamp(&self.key));
        if seen == current.seen && !settling(&seen.0) && !settling(&seen.1) {
            return current.served.clone();
        }
        current.seen = seen;
        let read = (
            std::fs::read(&self.cert).ok(),
            std::fs::read(&self.key).ok(),
        );
        if read == current.read {
            return current.served.clone();
        }
        current.read = read;
        match load(&self.cert, &self.key, &self.provider) {
            Ok(pair) => {
                current.served = Arc::new(pair);
                tracing::info!(
                    cert = %self.cert.display(),
                    key = %self.key.display(),
                    "TLS certificate reloaded: new handshakes get the new one"
                );
            }
            Err(e) => tracing::warn!(
                setting = e.setting,
                "the changed TLS files cannot be used, the certificate already served stays: {e}"
            ),
        }
        current.served.clone()
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// Reads the certificate chain and its key, and checks that they belong
/// together.
fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, ConfigError> {
    let refuse = |setting, problem| ConfigError { setting, problem };
    let bytes = std::fs::read(cert)
        .map_err(|e| refuse("tls_cert", format!("cannot read {}: {e}", cert.display())))?;
    let chain = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            refuse(
                "tls_cert",
                format!("{} is not a PEM file: {e}", cert.display()),
            )
        })?;
    if chain.is_empty() {
        return Err(refuse(
            "tls_cert",
            format!(
                "{} holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)",
                cert.display()
            ),
        ));
    }
    let bytes = std::fs::read(key)
        .map_err(|e| refuse("tls_key", format!("cannot read {}: {e}", key.display())))?;
    let der = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        refuse(
            "tls_key",
            format!(
                "{} holds no usable private key (expected PEM: -----BEGIN PRIVATE KEY-----): {e}",
                key.display()
            ),
        )
    })?;
    let signing = provider.key_provider.load_private_key(der).map_err(|e| {
        refuse(
            "tls_key",
            format!("{}: cannot use this key: {e}", key.display()),
        )
    })?;
    let pair = CertifiedKey::new(chain, signing);
    match pair.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(pair)
        }
        Err(e) => Err(refuse(
            "tls_key",
            format!(
                "{} is not the key of the certificate in {{tls_cert}} ({}): {e}",
                key.display(),
                cert.display()
            ),
        )),
    }
}

/// The start-up line of the listeners' TLS: which files, and whether
/// clients must show a certificate.
pub fn log_tls(tls: &TlsArgs) {
    let (Some(cert), Some(key)) = (&tls.tls_cert, &tls.tls_key) else {
        return;
    };
    match &tls.tls_client_ca {
        Some(ca) => tracing::info!(
            cert = %cert.display(),
            key = %key.display(),
            client_ca = %ca.display(),
            "https with client certificates (mutual TLS): HTTP/2 and HTTP/1.1; the certificate \
             and key are read again when they change"
        ),
        None => tracing::info!(
            cert = %cert.display(),
            key = %key.display(),
            "https: HTTP/2 and HTTP/1.1; the certificate and key are read again when they change"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_changed_pair_is_served_and_a_bad_one_keeps_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        let (a_cert, a_key) = pair("a.test");
        std::fs::write(&cert, &a_cert).unwrap();
        std::fs::write(&key, &a_key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let r = Reloading::new(cert.clone(), key.clone(), provider).unwrap();
        let first = r.current().cert[0].clone();

        // Half a certificate: the old pair stays.
        std::fs::write(&cert, &a_cert[..a_cert.len() / 2]).unwrap();
        assert_eq!(r.current().cert[0], first);
        // Another's certificate with the old key: the old pair stays.
        let (b_cert, b_key) = pair("b.test");
        std::fs::write(&cert, &b_cert).unwrap();
        assert_eq!(r.current().cert[0], first);
        // Its key too: the new pair.
        std::fs::write(&key, &b_key).unwrap();
        let second = r.current().cert[0].clone();
        assert_ne!(second, first);
        assert_eq!(
            second.as_ref(),
            CertificateDer::from_pem_slice(b_cert.as_bytes())
                .unwrap()
                .as_ref()
        );
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, pair("a.test").0).unwrap();
        std::fs::write(&key, pair("b.test").1).unwrap();
        let provider = rustls::crypto::ring::default_provider();
        let e = load(&cert, &key, &provider).unwrap_err();
        assert_eq!(e.setting, "tls_key", "{e}");
        std::fs::write(&cert, "nothing\n").unwrap();
        let e = load(&cert, &key, &provider).unwrap_err();
        assert_eq!(e.setting, "tls_cert", "{e}");
    }
}
