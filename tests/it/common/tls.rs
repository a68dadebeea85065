//! An origin that speaks only TLS, with a certificate authority made for the
//! test: the test's upstream router behind rustls, on a real socket.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ServerConfig};

use super::upstream::{Counts, router};

/// A certificate authority of the test's own.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Writes its certificate into `dir` as `file`, and gives the path.
    pub fn write(&self, dir: &tempfile::TempDir, file: &str) -> PathBuf {
        let path = dir.path().join(file);
        std::fs::write(&path, &self.pem).unwrap();
        path
    }

    /// A TLS server's side with a leaf certificate of this CA for `names`.
    pub fn acceptor(&self, names: &[&str]) -> TlsAcceptor {
        let (cert, key) = self.leaf(names);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
        TlsAcceptor::from(Arc::new(config))
    }

    /// A server's certificate for `names` (DNS names or IP addresses) and
    /// its key, both PEM, signed by this CA.
    pub fn leaf_pem(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let params = CertificateParams::new(names).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A client's certificate whose common name is `name` (what PostgreSQL's
    /// `cert` authentication takes for the role), and its key, both PEM.
    pub fn client_pem(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A leaf certificate for `names` (DNS names or IP addresses) and its
    /// key, signed by this CA.
    fn leaf(
        &self,
        names: &[&str],
    ) -> (
        rustls::pki_types::CertificateDer<'static>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let params = CertificateParams::new(names).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        (cert.der().clone(), key)
    }
}

/// The test's upstream router, served over TLS only.
pub struct TlsOrigin {
    pub port: u16,
    pub counts: Arc<Counts>,
    /// TLS handshakes that completed.
    pub handshakes: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl TlsOrigin {
    /// Serves on 127.0.0.1, port 0, with a certificate from `ca` for `names`.
    pub async fn start(ca: &TestCa, names: &[&str]) -> TlsOrigin {
        let acceptor = ca.acceptor(names);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let counts = Arc::new(Counts::default());
        let handshakes = Arc::new(AtomicUsize::new(0));
        let app = router(counts.clone());
        let shaken = handshakes.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let app = app.clone();
                let shaken = shaken.clone();
                tokio::spawn(async move {
                    // A client that does not trust us ends the handshake.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    shaken.fetch_add(1, Ordering::SeqCst);
                    let service = TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        TlsOrigin {
            port,
            counts,
            handshakes,
            task,
        }
    }

    /// Completed TLS handshakes so far.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}
