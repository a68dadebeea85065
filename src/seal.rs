//! Stored responses sealed at rest (`IDEMGATE_SEAL_KEY`,
//! AES-256-GCM), so that a database dump reveals no response header or body.
//!
//! No schema change: a sealed response keeps its status in the clear and
//! stores one marker header, `@idemgate-sealed: v1 key=<key id>`, with the
//! sealed blob as its body. `@` is not a valid character in an HTTP field
//! name, so no real response carries that header. The blob is
//!
//! ```text
//! version (1 byte, 1) | key id (8 bytes) | nonce (12 bytes, random) | AES-256-GCM ciphertext + tag
//! ```
//!
//! where the key id is the first 8 bytes of SHA-256 of the key (it tells the
//! configured keys apart; it does not reveal the key) and the plaintext is the
//! header list as JSON, its length first (4 bytes, big-endian), then the body.
//! The associated data binds the format version, the status, the tenant and
//! the reservation id that completed the record (unique per record, stored in
//! the same row): a blob moved to another record, or a status edited in the
//! database, fails to open. A blob that cannot be opened (unknown key,
//! tampered bytes) is an error, never replayed and never executed again: the
//! door answers `500 internal`, and the log line names the key id.
//!
//! To rotate, the new key becomes `IDEMGATE_SEAL_KEY` and the old one moves to
//! `IDEMGATE_SEAL_KEY_PREVIOUS`: records are sealed under the current key and
//! opened under any. A record found in the clear while sealing is on (stored
//! before sealing was turned on, or written into the database by hand) is
//! refused like one that cannot be opened — never replayed, never run again
//! — unless [`Sealer::accepting_plaintext`] (`IDEMGATE_SEAL_ACCEPT_PLAINTEXT`,
//! the key window after sealing is turned on) says to accept it: without
//! that, anyone who can write to the table could downgrade a sealed record
//! and have a caller replayed a cookie or a page of theirs.
//! Checkpoint recovery data is sealed the same way, as an object of exactly
//! two members, `{"@idemgate-sealed": "v1 key=…", "sealed": "<base64>"}`,
//! bound to the tenant, the key and the recovery point (whose name stays in
//! the clear).

use aes_gcm::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::store::{ClaimedRequest, KeptRequest, Record, StoreError, StoredResponse};

/// The name of the marker header of a sealed response.
pub const SEALED_HEADER: &str = "@idemgate-sealed";

const VERSION: u8 = 1;
const KEY_ID_LEN: usize = 8;
const NONCE_LEN: usize = 12;
const PREFIX_LEN: usize = 1 + KEY_ID_LEN + NONCE_LEN;

/// The member of sealed recovery data that holds the base64 blob.
const SEALED_DATA: &str = "sealed";

/// The recovery point's name stored for a checkpoint sealed whole (its real
/// name is sealed with its data: [`Sealer::seal_checkpoint`]).
pub const SEALED_POINT: &str = "@idemgate-sealed";

/// Whether checkpoint recovery data is in sealed form: an object of exactly
/// the marker and the blob. (Unlike a header name, any JSON object could be a
/// caller's own data; one of this exact shape is read as sealed, and a
/// caller who stores such an object itself gets its own data refused on
/// takeover, never another's.)
pub fn is_sealed_recovery(data: &serde_json::Value) -> bool {
    data.as_object().is_some_and(|o| {
        o.len() == 2
            && o.get(SEALED_HEADER)
                .and_then(serde_json::Value::as_str)
                .is_some_and(|m| m.starts_with("v1 key=") || m.starts_with("v2 key="))
            && o.get(SEALED_DATA).is_some_and(serde_json::Value::is_string)
    })
}

/// Whether `response` is in sealed form. Cheap: looks at the first header name.
pub fn is_sealed(response: &StoredResponse) -> bool {
    response
        .headers
        .first()
        .is_some_and(|(name, _)| name == SEALED_HEADER)
}

/// The key id of a sealed response, in hex, as its marker header names it.
pub fn sealed_key_id(response: &StoredResponse) -> Option<&str> {
    let (name, value) = response.headers.first()?;
    (name == SEALED_HEADER)
        .then(|| value.strip_prefix("v1 key="))
        .flatten()
}

/// Why a sealed response could not be opened. Never holds key material.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpenError {
    /// The record was sealed, but this process has no seal key.
    #[error("the stored response is sealed but no IDEMGATE_SEAL_KEY is configured")]
    NoKey,
    /// Sealed under a key that is neither the seal key nor a previous one.
    #[error(
        "the stored response is sealed under key id {0}, which is neither IDEMGATE_SEAL_KEY nor in IDEMGATE_SEAL_KEY_PREVIOUS"
    )]
    UnknownKey(String),
    /// The blob is malformed, tampered with, or moved from another record.
    #[error("the sealed response failed authentication (tampered with, truncated or moved)")]
    Corrupt,
    /// Sealing is on and the record holds a response or recovery data in
    /// the clear: written before sealing was turned on, or planted by
    /// whoever can write to the database. Nobody without the seal key can
    /// make a sealed record, so an unsealed one is not trusted.
    #[error(
        "the stored record is not sealed although IDEMGATE_SEAL_KEY is set (stored before sealing \
         was turned on, or written into the database by hand); set \
         IDEMGATE_SEAL_ACCEPT_PLAINTEXT=true for the key window after turning sealing on"
    )]
    Unsealed,
}

struct SealKey {
    id: [u8; KEY_ID_LEN],
    cipher: Aes256Gcm,
    /// The keys of the keyed hashes, one per label.
    names: NameKeys,
}

/// The HMAC-SHA-256 keys a seal key names records with, each derived from it
/// under a label of its own ([`Sealer::key_hash`] and its siblings), kept
/// with the key's pads already hashed: a name then costs two blocks of
/// SHA-256 more than its plain hash, not four.
struct NameKeys {
    key_hash: hmac::Hmac<Sha256>,
    tenant: hmac::Hmac<Sha256>,
    fingerprint: hmac::Hmac<Sha256>,
}

impl NameKeys {
    fn new(key: &[u8; 32]) -> NameKeys {
        let derive = |label: &[u8]| mac(&hmac_sha256(&mac(key), &[label]));
        NameKeys {
            key_hash: derive(b"idemgate v1 key hash"),
            tenant: derive(b"idemgate v1 tenant"),
            fingerprint: derive(b"idemgate v1 fingerprint"),
        }
    }
}

/// HMAC-SHA-256 under `key`, its pads hashed, ready to be cloned per message.
fn mac(key: &[u8]) -> hmac::Hmac<Sha256> {
    <hmac::Hmac<Sha256> as hmac::Mac>::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// HMAC-SHA-256 of the concatenation of `parts` under the prepared `key`.
fn hmac_sha256(key: &hmac::Hmac<Sha256>, parts: &[&[u8]]) -> [u8; 32] {
    use hmac::Mac as _;
    let mut mac = key.clone();
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

impl SealKey {
    fn new(key: &[u8; 32]) -> SealKey {
        let digest = Sha256::digest(key);
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&digest[..KEY_ID_LEN]);
        SealKey {
            id,
            cipher: Aes256Gcm::new(key.into()),
            names: NameKeys::new(key),
        }
    }
}

/// How a key's record is named in the database: its key hash, its tenant
/// when that is derived from a credential, and its fingerprint.
///
/// Without sealing, and in the window after sealing is turned on, names are
/// [`Naming::Plain`]: SHA-256 of the key, of the credential, of the request.
/// Under sealing they are [`Naming::Keyed`]: HMAC-SHA-256 of those plain
/// names under keys derived from a seal key (0: `IDEMGATE_SEAL_KEY`, 1…: the
/// previous keys in order), so that a dump and a dictionary of likely keys,
/// passwords and bodies reveal none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// SHA-256 names, as stored without sealing.
    Plain,
    /// HMAC-SHA-256 names under the seal key at this index (0: current).
    Keyed(usize),
}

/// Seals responses under the current key and opens them under it or a
/// previous one. `Debug` shows key ids only.
pub struct Sealer {
    current: SealKey,
    previous: Vec<SealKey>,
    /// Whether records in the clear are still opened
    /// (`IDEMGATE_SEAL_ACCEPT_PLAINTEXT`): the window after sealing is turned
    /// on. Otherwise an unsealed record is refused, never replayed.
    accept_plaintext: bool,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("key_id", &self.key_id())
            .field("previous", &self.previous.len())
            .field("accept_plaintext", &self.accept_plaintext)
            .finish()
    }
}

/// A seal setting that cannot be used: which one, and why (never its value).
#[derive(Debug, PartialEq, Eq)]
pub struct SealKeyError {
    /// `IDEMGATE_SEAL_KEY` or `IDEMGATE_SEAL_KEY_PREVIOUS`.
    pub setting: &'static str,
    /// What is wrong.
    pub problem: String,
}

/// Decodes one base64 key of exactly 32 bytes.
fn decode_key(setting: &'static str, text: &str) -> Result<[u8; 32], SealKeyError> {
    let text = text.trim();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(text))
        .map_err(|_| SealKeyError {
            setting,
            problem: "not valid base64 (expected 32 random bytes, base64-encoded: \
                      `openssl rand -base64 32`)"
                .into(),
        })?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| SealKeyError {
        setting,
        problem: format!(
            "decodes to {} bytes; an AES-256 key is exactly 32 bytes (`openssl rand -base64 32`)",
            bytes.len()
        ),
    })
}

impl Sealer {
    /// A sealer that seals under `current` and also opens under `previous`.
    pub fn new(current: &[u8; 32], previous: &[[u8; 32]]) -> Sealer {
        Sealer {
            current: SealKey::new(current),
            previous: previous.iter().map(SealKey::new).collect(),
            accept_plaintext: false,
        }
    }

    /// The same sealer, opening records stored in the clear too when
    /// `accept` is true (`IDEMGATE_SEAL_ACCEPT_PLAINTEXT`: the key window
    /// after sealing is turned on, when records from before it are still
    /// alive). By default a record in the clear is refused: a row written
    /// into the database by hand must not be replayed to a caller.
    #[must_use]
    pub fn accepting_plaintext(mut self, accept: bool) -> Sealer {
        self.accept_plaintext = accept;
        self
    }

    /// Whether records stored in the clear are opened
    /// ([`accepting_plaintext`](Self::accepting_plaintext)).
    pub fn accepts_plaintext(&self) -> bool {
        self.accept_plaintext
    }

    /// `Ok` if a record part found in the clear may be used.
    fn plaintext_allowed(&self) -> Result<(), OpenError> {
        if self.accept_plaintext {
            Ok(())
        } else {
            Err(OpenError::Unsealed)
        }
    }

    /// A sealer from the settings' text: `current` base64, `previous`
    /// comma-separated base64 keys (empty entries ignored).
    pub fn from_settings(current: &str, previous: Option<&str>) -> Result<Sealer, SealKeyError> {
        let current = decode_key("IDEMGATE_SEAL_KEY", current)?;
        let previous = previous
            .unwrap_or_default()
            .split(',')
            .filter(|k| !k.trim().is_empty())
            .map(|k| decode_key("IDEMGATE_SEAL_KEY_PREVIOUS", k))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Sealer::new(&current, &previous))
    }

    /// The namings a record of this sealer may be kept under, the one new
    /// records are written under first.
    ///
    /// New records are named under the current key, and one named under a
    /// previous key (during a rotation) is found too. With
    /// [`accepting_plaintext`](Self::accepting_plaintext), the window after
    /// sealing was turned on, new records keep their plain names instead, so
    /// that processes that do not key names yet (one without the seal key,
    /// or of a release before keyed names) find them, and keyed ones are
    /// found too. `plain_window` adds the plain names after those: records a
    /// process in that window wrote are still alive.
    pub fn namings(&self, plain_window: bool) -> Vec<Naming> {
        let keyed = (0..=self.previous.len()).map(Naming::Keyed);
        if self.accept_plaintext {
            std::iter::once(Naming::Plain).chain(keyed).collect()
        } else {
            keyed.chain(plain_window.then_some(Naming::Plain)).collect()
        }
    }

    fn names(&self, index: usize) -> &NameKeys {
        match index {
            0 => &self.current.names,
            i => &self.previous[i - 1].names,
        }
    }

    /// The key hash of a key whose SHA-256 is `plain`, under `naming`.
    pub fn key_hash(&self, naming: Naming, plain: &[u8; 32]) -> [u8; 32] {
        match naming {
            Naming::Plain => *plain,
            Naming::Keyed(i) => hmac_sha256(&self.names(i).key_hash, &[plain]),
        }
    }

    /// The tenant derived from a credential whose plain tenant (the hex
    /// SHA-256 of the credential) is `plain`, under `naming`: lowercase hex.
    pub fn tenant(&self, naming: Naming, plain: &str) -> String {
        match naming {
            Naming::Plain => plain.to_owned(),
            Naming::Keyed(i) => {
                hex::encode(hmac_sha256(&self.names(i).tenant, &[plain.as_bytes()]))
            }
        }
    }

    /// A fingerprint (computed, or a caller's own) under `naming`: as it is,
    /// or the lowercase hex HMAC of it.
    pub fn fingerprint(&self, naming: Naming, plain: &str) -> String {
        match naming {
            Naming::Plain => plain.to_owned(),
            Naming::Keyed(i) => {
                hex::encode(hmac_sha256(&self.names(i).fingerprint, &[plain.as_bytes()]))
            }
        }
    }

    /// The ids of every configured key, current first, in hex.
    pub fn key_ids(&self) -> Vec<String> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .map(|k| hex::encode(k.id))
            .collect()
    }

    /// The current key's id, in hex.
    pub fn key_id(&self) -> String {
        hex::encode(self.current.id)
    }

    fn aad(status: u16, tenant: &str, reservation_id: Uuid) -> Vec<u8> {
        let mut aad = Vec::with_capacity(32 + tenant.len());
        aad.extend_from_slice(b"idemgate-seal");
        aad.push(VERSION);
        aad.extend_from_slice(&status.to_be_bytes());
        aad.extend_from_slice(&(tenant.len() as u64).to_be_bytes());
        aad.extend_from_slice(tenant.as_bytes());
        aad.extend_from_slice(reservation_id.as_bytes());
        aad
    }

    /// `version | key id | nonce | ciphertext + tag` of `plain` under the
    /// current key, bound to `aad`.
    fn seal_blob(&self, plain: &[u8], aad: &[u8]) -> Vec<u8> {
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let sealed = self
            .current
            .cipher
            .encrypt(&nonce, Payload { msg: plain, aad })
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        let mut blob = Vec::with_capacity(PREFIX_LEN + sealed.len());
        blob.push(VERSION);
        blob.extend_from_slice(&self.current.id);
        blob.extend_from_slice(&nonce);
        blob.extend_from_slice(&sealed);
        blob
    }

    /// What [`Sealer::seal_blob`] sealed, under whichever configured key it
    /// names.
    fn open_blob(&self, blob: &[u8], aad: &[u8]) -> Result<Vec<u8>, OpenError> {
        if blob.len() < PREFIX_LEN || blob[0] != VERSION {
            return Err(OpenError::Corrupt);
        }
        let id = &blob[1..1 + KEY_ID_LEN];
        let key = std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == id)
            .ok_or_else(|| OpenError::UnknownKey(hex::encode(id)))?;
        let nonce: [u8; NONCE_LEN] = blob[1 + KEY_ID_LEN..PREFIX_LEN]
            .try_into()
            .map_err(|_| OpenError::Corrupt)?;
        key.cipher
            .decrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: &blob[PREFIX_LEN..],
                    aad,
                },
            )
            .map_err(|_| OpenError::Corrupt)
    }

    /// The marker's value: the format version and the current key's id.
    fn marker(&self) -> String {
        format!("v1 key={}", self.key_id())
    }

    /// The sealed form of `response`, for the record of `tenant` completed by
    /// `reservation_id`.
    pub fn seal(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        response: &StoredResponse,
    ) -> StoredResponse {
        let headers =
            serde_json::to_vec(&response.headers).expect("a list of string pairs serializes");
        let mut plain = Vec::with_capacity(4 + headers.len() + response.body.len());
        plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        plain.extend_from_slice(&headers);
        plain.extend_from_slice(&response.body);
        let aad = Self::aad(response.status, tenant, reservation_id);
        StoredResponse {
            status: response.status,
            headers: vec![(SEALED_HEADER.to_owned(), self.marker())],
            body: self.seal_blob(&plain, &aad).into(),
        }
    }

    /// The response that `sealed` (in sealed form) holds.
    pub fn open(
        &self,
        tenant: &str,
        reservation_id: Uuid,
        sealed: &StoredResponse,
    ) -> Result<StoredResponse, OpenError> {
        let aad = Self::aad(sealed.status, tenant, reservation_id);
        let plain = self.open_blob(&sealed.body, &aad)?;
        let (len, rest) = plain.split_at_checked(4).ok_or(OpenError::Corrupt)?;
        let len = u32::from_be_bytes(len.try_into().map_err(|_| OpenError::Corrupt)?) as usize;
        let headers = rest.get(..len).ok_or(OpenError::Corrupt)?;
        let headers = serde_json::from_slice(headers).map_err(|_| OpenError::Corrupt)?;
        // The body is the rest of the opened bytes, kept where it is.
        Ok(StoredResponse {
            status: sealed.status,
            headers,
            body: bytes::Bytes::from(plain).slice(4 + len..),
        })
    }

    fn recovery_aad(tenant: &str, key_hash: &[u8], recovery_point: &str) -> Vec<u8> {
        let mut aad = Vec::with_capacity(64 + tenant.len() + recovery_point.len());
        aad.extend_from_slice(b"idemgate-seal-recovery");
        aad.push(VERSION);
        aad.extend_from_slice(&(tenant.len() as u64).to_be_bytes());
        aad.extend_from_slice(tenant.as_bytes());
        aad.extend_from_slice(&(key_hash.len() as u64).to_be_bytes());
        aad.extend_from_slice(key_hash);
        aad.extend_from_slice(recovery_point.as_bytes());
        aad
    }

    /// The sealed form of a checkpoint's recovery `data`, for the key
    /// `key_hash` of `tenant` at `recovery_point` (which stays in the clear:
    /// it names a step, and the blob is bound to it).
    pub fn seal_recovery(
        &self,
        tenant: &str,
        key_hash: &[u8],
        recovery_point: &str,
        data: &serde_json::Value,
    ) -> serde_json::Value {
        let plain = serde_json::to_vec(data).expect("a JSON value serializes");
        let aad = Self::recovery_aad(tenant, key_hash, recovery_point);
        let blob = self.seal_blob(&plain, &aad);
        serde_json::json!({
            SEALED_HEADER: self.marker(),
            SEALED_DATA: base64::engine::general_purpose::STANDARD.encode(blob),
        })
    }

    /// A checkpoint sealed whole: the recovery point's name as
    /// [`SEALED_POINT`], and as data the point's real name and its data,
    /// sealed together (marker `v2`) for the key `key_hash` of `tenant`, so
    /// that a dump holds neither. (Version 1 left the name in the clear; it
    /// is what a process writes in the window after sealing is turned on,
    /// which processes of a release that reads only version 1 may share.)
    pub fn seal_checkpoint(
        &self,
        tenant: &str,
        key_hash: &[u8],
        recovery_point: &str,
        data: Option<&serde_json::Value>,
    ) -> (String, serde_json::Value) {
        let plain = serde_json::to_vec(&serde_json::json!({
            "point": recovery_point,
            "data": data,
        }))
        .expect("a JSON value serializes");
        let aad = Self::recovery_aad(tenant, key_hash, SEALED_POINT);
        let blob = self.seal_blob(&plain, &aad);
        let marker = format!("v2 key={}", self.key_id());
        (
            SEALED_POINT.to_owned(),
            serde_json::json!({
                SEALED_HEADER: marker,
                SEALED_DATA: base64::engine::general_purpose::STANDARD.encode(blob),
            }),
        )
    }

    /// The recovery data that `sealed` (in the form [`Sealer::seal_recovery`]
    /// gives) holds.
    pub fn open_recovery(
        &self,
        tenant: &str,
        key_hash: &[u8],
        recovery_point: &str,
        sealed: &serde_json::Value,
    ) -> Result<serde_json::Value, OpenError> {
        let blob = sealed
            .get(SEALED_DATA)
            .and_then(serde_json::Value::as_str)
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .ok_or(OpenError::Corrupt)?;
        let aad = Self::recovery_aad(tenant, key_hash, recovery_point);
        let plain = self.open_blob(&blob, &aad)?;
        serde_json::from_slice(&plain).map_err(|_| OpenError::Corrupt)
    }

    fn request_aad(tenant: &str, key_hash: &[u8]) -> Vec<u8> {
        let mut aad = Vec::with_capacity(64 + tenant.len());
        aad.extend_from_slice(b"idemgate-seal-request");
        aad.push(VERSION);
        aad.extend_from_slice(&(tenant.len() as u64).to_be_bytes());
        aad.extend_from_slice(tenant.as_bytes());
        aad.extend_from_slice(key_hash);
        aad
    }

    /// The sealed form of the request a key of `tenant` was claimed for: a
    /// blob bound to the key (its first byte is the format's version, never
    /// the `{` of the open form).
    pub fn seal_request(&self, tenant: &str, key_hash: &[u8], request: &ClaimedRequest) -> Vec<u8> {
        self.seal_blob(&request.to_json(), &Self::request_aad(tenant, key_hash))
    }

    /// The request that `sealed` (as [`Sealer::seal_request`] gives it)
    /// holds.
    pub fn open_request(
        &self,
        tenant: &str,
        key_hash: &[u8],
        sealed: &[u8],
    ) -> Result<ClaimedRequest, OpenError> {
        let plain = self.open_blob(sealed, &Self::request_aad(tenant, key_hash))?;
        serde_json::from_slice(&plain).map_err(|_| OpenError::Corrupt)
    }
}

/// Every name a key's record may be kept under, the one new records get
/// first: the tenant (keyed too when `tenant_from_credential`, the proxy's
/// tenant made of a credential, given here in its plain form) and the key
/// hash, for a key whose SHA-256 is `plain`. What an operator who names a
/// key by its raw form looks for. Without sealing, the plain names alone.
pub fn names_of(
    sealer: Option<&Sealer>,
    tenant: &str,
    tenant_from_credential: bool,
    plain: &[u8; 32],
) -> Vec<(String, [u8; 32])> {
    let Some(sealer) = sealer else {
        return vec![(tenant.to_owned(), *plain)];
    };
    let mut names: Vec<(String, [u8; 32])> = Vec::new();
    for naming in sealer.namings(true) {
        let tenant = if tenant_from_credential {
            sealer.tenant(naming, tenant)
        } else {
            tenant.to_owned()
        };
        let name = (tenant, sealer.key_hash(naming, plain));
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Replaces a sealed response and sealed recovery data in `record` by
/// what they hold. A record that cannot be opened is a store error: it is
/// never replayed nor handed on.
pub(crate) fn open_record(sealer: Option<&Sealer>, record: &mut Record) -> Result<(), StoreError> {
    open_request(sealer, record);
    let opened = open_response(sealer, record).and_then(|()| open_recovery(sealer, record));
    opened.map_err(|why| {
        tracing::error!(
            tenant = %record.tenant,
            key.hash = %crate::key::hash_prefix(&record.key_hash),
            error = %why,
            "a stored record cannot be opened; answering 500 instead of using it"
        );
        StoreError::other(format!("sealed record: {why}"))
    })
}

/// The request a key was claimed for, opened. A label for the operator,
/// never replayed nor handed on: one that cannot be opened (sealed under a
/// key no longer configured) is left out of the record, and the record is
/// still served.
fn open_request(sealer: Option<&Sealer>, record: &mut Record) {
    let Some(KeptRequest::Sealed(blob)) = &record.request else {
        return;
    };
    let opened = sealer
        .ok_or(OpenError::NoKey)
        .and_then(|sealer| sealer.open_request(&record.tenant, &record.key_hash, blob));
    record.request = match opened {
        Ok(request) => Some(KeptRequest::Open(request)),
        Err(why) => {
            tracing::warn!(
                tenant = %record.tenant,
                key.hash = %crate::key::hash_prefix(&record.key_hash),
                error = %why,
                "the request a key was claimed for cannot be opened; shown without it"
            );
            None
        }
    };
}

fn open_response(sealer: Option<&Sealer>, record: &mut Record) -> Result<(), OpenError> {
    let Some(response) = record.response.as_mut() else {
        return Ok(());
    };
    if !is_sealed(response) {
        // In the clear: fine without sealing; under sealing, only in the
        // window that accepts records from before it.
        return sealer.map_or(Ok(()), Sealer::plaintext_allowed);
    }
    let sealer = sealer.ok_or(OpenError::NoKey)?;
    *response = sealer.open(&record.tenant, record.reservation_id, response)?;
    Ok(())
}

fn open_recovery(sealer: Option<&Sealer>, record: &mut Record) -> Result<(), OpenError> {
    let Some(recovery) = record.recovery.as_mut() else {
        return Ok(());
    };
    let Some(data) = recovery.data.as_mut() else {
        return Ok(());
    };
    if !is_sealed_recovery(data) {
        return sealer.map_or(Ok(()), Sealer::plaintext_allowed);
    }
    let sealer = sealer.ok_or(OpenError::NoKey)?;
    let whole = data
        .get(SEALED_HEADER)
        .and_then(serde_json::Value::as_str)
        .is_some_and(|m| m.starts_with("v2 key="));
    let opened = sealer.open_recovery(
        &record.tenant,
        &record.key_hash,
        &recovery.recovery_point,
        data,
    )?;
    if !whole {
        *data = opened;
        return Ok(());
    }
    // Sealed whole: the point's name and its data.
    let serde_json::Value::Object(mut both) = opened else {
        return Err(OpenError::Corrupt);
    };
    let Some(serde_json::Value::String(point)) = both.remove("point") else {
        return Err(OpenError::Corrupt);
    };
    recovery.recovery_point = point;
    recovery.data = match both.remove("data") {
        None | Some(serde_json::Value::Null) => None,
        Some(data) => Some(data),
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("x-secret".into(), "hdr-value".into())],
            body: bytes::Bytes::from_static(b"secret body"),
        }
    }

    #[test]
    fn round_trip_and_binding() {
        let a = Sealer::new(&[1; 32], &[]);
        let id = Uuid::new_v4();
        let sealed = a.seal("acme", id, &response());
        assert!(is_sealed(&sealed));
        assert_eq!(sealed_key_id(&sealed), Some(a.key_id().as_str()));
        assert_eq!(a.open("acme", id, &sealed).unwrap(), response());
        // Another tenant, another record, another status: refused.
        assert_eq!(a.open("globex", id, &sealed), Err(OpenError::Corrupt));
        assert_eq!(
            a.open("acme", Uuid::new_v4(), &sealed),
            Err(OpenError::Corrupt)
        );
        let mut status = sealed.clone();
        status.status = 200;
        assert_eq!(a.open("acme", id, &status), Err(OpenError::Corrupt));
        // Every single-byte change is detected.
        for i in 0..sealed.body.len() {
            let mut t = sealed.clone();
            let mut body = t.body.to_vec();
            body[i] ^= 0x01;
            t.body = body.into();
            assert!(a.open("acme", id, &t).is_err(), "byte {i}");
        }
        let mut short = sealed.clone();
        short.body.truncate(5);
        assert_eq!(a.open("acme", id, &short), Err(OpenError::Corrupt));
    }

    #[test]
    fn recovery_data_round_trips_bound_to_its_key_and_step() {
        let a = Sealer::new(&[1; 32], &[]);
        let data = serde_json::json!({"charge": "ch_123", "amount": 4200});
        let sealed = a.seal_recovery("acme", &[7; 32], "charged", &data);
        assert!(is_sealed_recovery(&sealed));
        assert!(!is_sealed_recovery(&data));
        let text = sealed.to_string();
        assert!(!text.contains("ch_123"), "{text}");
        assert_eq!(
            a.open_recovery("acme", &[7; 32], "charged", &sealed),
            Ok(data.clone())
        );
        // Another tenant, key or step: refused.
        for (tenant, key, step) in [
            ("globex", [7; 32], "charged"),
            ("acme", [8; 32], "charged"),
            ("acme", [7; 32], "shipped"),
        ] {
            assert_eq!(
                a.open_recovery(tenant, &key, step, &sealed),
                Err(OpenError::Corrupt)
            );
        }
        // Rotation: opens under a previous key, not under a stranger's.
        let b = Sealer::new(&[2; 32], &[[1; 32]]);
        assert_eq!(
            b.open_recovery("acme", &[7; 32], "charged", &sealed),
            Ok(data)
        );
        assert!(matches!(
            Sealer::new(&[3; 32], &[]).open_recovery("acme", &[7; 32], "charged", &sealed),
            Err(OpenError::UnknownKey(_))
        ));
    }

    /// The names a seal key gives are a stored format: a change renames
    /// every record, and a process that looked under the new names would
    /// run their requests again. Pinned to HMAC-SHA-256 computed here by
    /// its definition (RFC 2104), under the key derived with each label.
    #[test]
    fn keyed_names_are_hmac_sha256_under_a_derived_key_each() {
        fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
            let mut block = [0u8; 64];
            block[..key.len()].copy_from_slice(key);
            let pad = |b: u8| block.iter().map(|k| k ^ b).collect::<Vec<u8>>();
            let inner = Sha256::new()
                .chain_update(pad(0x36))
                .chain_update(message)
                .finalize();
            Sha256::new()
                .chain_update(pad(0x5c))
                .chain_update(inner)
                .finalize()
                .into()
        }
        let seal_key = [9u8; 32];
        let a = Sealer::new(&seal_key, &[]);
        let plain: [u8; 32] = Sha256::digest(b"order-42").into();
        let derived = hmac(&seal_key, b"idemgate v1 key hash");
        assert_eq!(a.key_hash(Naming::Keyed(0), &plain), hmac(&derived, &plain));
        let derived = hmac(&seal_key, b"idemgate v1 tenant");
        assert_eq!(
            a.tenant(Naming::Keyed(0), "abc"),
            hex::encode(hmac(&derived, b"abc"))
        );
        let derived = hmac(&seal_key, b"idemgate v1 fingerprint");
        assert_eq!(
            a.fingerprint(Naming::Keyed(0), "fp"),
            hex::encode(hmac(&derived, b"fp"))
        );
        // Plain is the SHA-256 as it was; a previous key names as it did.
        assert_eq!(a.key_hash(Naming::Plain, &plain), plain);
        let rotated = Sealer::new(&[1; 32], &[seal_key]);
        assert_eq!(
            rotated.key_hash(Naming::Keyed(1), &plain),
            a.key_hash(Naming::Keyed(0), &plain)
        );
        assert_ne!(
            rotated.key_hash(Naming::Keyed(0), &plain),
            a.key_hash(Naming::Keyed(0), &plain)
        );
    }

    #[test]
    fn a_checkpoint_sealed_whole_hides_its_point_and_opens_whole() {
        let a = Sealer::new(&[1; 32], &[]);
        let data = serde_json::json!({"charge": "ch_123"});
        let (point, sealed) = a.seal_checkpoint("acme", &[7; 32], "charged-card", Some(&data));
        assert_eq!(point, SEALED_POINT);
        assert!(is_sealed_recovery(&sealed));
        assert!(!sealed.to_string().contains("charged-card"));
        let now = chrono::Utc::now();
        let mut record = crate::store::Record {
            tenant: "acme".into(),
            key_hash: vec![7; 32],
            fingerprint: None,
            state: crate::store::KeyState::InFlight,
            reservation_id: Uuid::new_v4(),
            lease_expires_at: Some(now),
            attempt: 1,
            recovery: Some(crate::store::Recovery {
                recovery_point: point,
                data: Some(sealed),
            }),
            response: None,
            created_at: now,
            completed_at: None,
            expires_at: now,
            on_lease_expiry: crate::store::LeaseExpiry::Takeover,
            resolution: None,
            marked_unknown: None,
            request: None,
        };
        open_record(Some(&a), &mut record).unwrap();
        let recovery = record.recovery.unwrap();
        assert_eq!(recovery.recovery_point, "charged-card");
        assert_eq!(recovery.data, Some(data));
    }

    #[test]
    fn rotation_opens_previous_keys_only() {
        let id = Uuid::new_v4();
        let old = Sealer::new(&[1; 32], &[]).seal("t", id, &response());
        let rotated = Sealer::new(&[2; 32], &[[1; 32]]);
        assert_eq!(rotated.open("t", id, &old).unwrap(), response());
        let new = rotated.seal("t", id, &response());
        assert_eq!(sealed_key_id(&new), Some(rotated.key_id().as_str()));
        let only_b = Sealer::new(&[2; 32], &[]);
        assert!(matches!(
            only_b.open("t", id, &old),
            Err(OpenError::UnknownKey(_))
        ));
    }

    #[test]
    fn settings_are_checked_without_echoing_them() {
        let good = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        assert!(Sealer::from_settings(&good, Some(&format!("{good}, {good}"))).is_ok());
        let e = Sealer::from_settings("not base64!!", None).unwrap_err();
        assert_eq!(e.setting, "IDEMGATE_SEAL_KEY");
        assert!(!e.problem.contains("not base64!!"));
        let short = base64::engine::general_purpose::STANDARD.encode([7u8; 16]);
        let e = Sealer::from_settings(&short, None).unwrap_err();
        assert!(e.problem.contains("16 bytes"), "{}", e.problem);
        let e = Sealer::from_settings(&good, Some(&short)).unwrap_err();
        assert_eq!(e.setting, "IDEMGATE_SEAL_KEY_PREVIOUS");
    }
}
