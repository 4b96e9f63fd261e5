//! Publisher signatures on registry index lines (docs/REGISTRY.md, "Signatures").
//!
//! An index line's checksum proves that an archive is the one the line names (integrity); a
//! signature proves who published it (authenticity). A publisher signs, with an ed25519 key
//! (RFC 8032, through `ed25519-dalek`), the message
//!
//! ```text
//! kiln-index-signature-v1\n{name}\n{vers}\n{abi}\n{cksum}\n
//! ```
//!
//! which binds the package name, version, ABI and the archive's sha256: any other archive, or
//! the same archive under another name or version, does not verify. `yanked` is not signed (a
//! registry's owner may yank). Keys are written `ed25519:` + 64 hex digits (public) and kept in
//! a secret-key file `kiln-ed25519-secret-v1 ` + 64 hex digits, mode 0600.

use std::fmt;
use std::path::Path;

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::IndexLine;

const SECRET_TAG: &str = "kiln-ed25519-secret-v1";
const PUBLIC_PREFIX: &str = "ed25519:";

/// A publisher's public key (`ed25519:HEX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PUBLIC_PREFIX}{}", hex::encode(self.0.as_bytes()))
    }
}

impl std::str::FromStr for PublicKey {
    type Err = String;

    /// `ed25519:` and 64 hex digits.
    fn from_str(s: &str) -> Result<PublicKey, String> {
        let bad = || format!("{s:?} is not a public key (ed25519: and 64 hex digits, as `kiln key new` prints)");
        let hex = s.strip_prefix(PUBLIC_PREFIX).ok_or_else(bad)?;
        let bytes: [u8; 32] = hex::decode(hex).ok().and_then(|b| b.try_into().ok()).ok_or_else(bad)?;
        VerifyingKey::from_bytes(&bytes).map(PublicKey).map_err(|_| bad())
    }
}

/// A publisher's secret key.
pub struct SecretKey(SigningKey);

impl SecretKey {
    /// A new key from the operating system's random source.
    pub fn generate() -> Result<SecretKey, String> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| format!("no random source for a new key: {e}"))?;
        Ok(SecretKey(SigningKey::from_bytes(&seed)))
    }

    /// Reads a secret-key file (`kiln key new` writes one).
    pub fn read(path: &Path) -> Result<SecretKey, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: {e} (a secret-key file that `kiln key new` wrote)", path.display()))?;
        let bad = || format!("{}: not a kiln secret key file ({SECRET_TAG} and 64 hex digits)", path.display());
        let hex = text.trim().strip_prefix(SECRET_TAG).ok_or_else(bad)?.trim();
        let bytes: [u8; 32] = hex::decode(hex).ok().and_then(|b| b.try_into().ok()).ok_or_else(bad)?;
        Ok(SecretKey(SigningKey::from_bytes(&bytes)))
    }

    /// Writes the key to a new file `path`, readable by this user only. Errors: the file exists.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut f = options.open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        writeln!(f, "{SECRET_TAG} {}", hex::encode(self.0.to_bytes())).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }
}

/// A line's signature: the signer's public key and the ed25519 signature, hex.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LineSignature {
    pub key: String,
    pub sig: String,
}

/// The signed message of `line` (module documentation).
pub fn message(line: &IndexLine) -> Vec<u8> {
    format!("kiln-index-signature-v1\n{}\n{}\n{}\n{}\n", line.name, line.vers, line.abi, line.cksum).into_bytes()
}

/// Signs `line` with `key`.
pub fn sign(line: &mut IndexLine, key: &SecretKey) {
    let sig = key.0.sign(&message(line));
    line.signature = Some(LineSignature { key: key.public().to_string(), sig: hex::encode(sig.to_bytes()) });
}

/// The key that signed `line`: `Ok(None)` when unsigned, an error when the signature does not
/// verify (another archive, name or version than was signed, or a damaged signature).
pub fn verify(line: &IndexLine) -> Result<Option<PublicKey>, String> {
    let Some(s) = &line.signature else { return Ok(None) };
    let key: PublicKey = s.key.parse()?;
    let bytes: [u8; 64] = hex::decode(&s.sig)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("its signature is not 128 hex digits: {:?}", s.sig))?;
    let sig = ed25519_dalek::Signature::from_bytes(&bytes);
    key.0.verify_strict(&message(line), &sig).map_err(|_| {
        format!("its signature by {key} does not verify (the archive, name or version is not what was signed)")
    })?;
    Ok(Some(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line() -> IndexLine {
        IndexLine {
            name: "p".into(),
            vers: "1.0.0".parse().unwrap(),
            abi: 1,
            cksum: "ab".repeat(32),
            ops: Vec::new(),
            device: Default::default(),
            deps: Default::default(),
            yanked: false,
            signature: None,
        }
    }

    #[test]
    fn a_signature_verifies_for_its_line_only() {
        let key = SecretKey::generate().unwrap();
        let mut l = line();
        assert_eq!(verify(&l), Ok(None));
        sign(&mut l, &key);
        assert_eq!(verify(&l), Ok(Some(key.public())));
        // Yanking does not touch what was signed.
        l.yanked = true;
        assert_eq!(verify(&l), Ok(Some(key.public())));
        for change in [
            |l: &mut IndexLine| l.cksum = "cd".repeat(32),
            |l: &mut IndexLine| l.vers = "1.0.1".parse().unwrap(),
            |l: &mut IndexLine| l.name = "q".into(),
        ] {
            let mut other = l.clone();
            change(&mut other);
            assert!(verify(&other).unwrap_err().contains("does not verify"));
        }
        // Another key's name on this signature does not verify either.
        let mut forged = l.clone();
        forged.signature.as_mut().unwrap().key = SecretKey::generate().unwrap().public().to_string();
        assert!(verify(&forged).unwrap_err().contains("does not verify"));
    }

    #[test]
    fn keys_round_trip_through_their_text() {
        let key = SecretKey::generate().unwrap();
        let text = key.public().to_string();
        assert_eq!(text.parse::<PublicKey>().unwrap(), key.public());
        assert!("ed25519:zz".parse::<PublicKey>().is_err() && "abcd".parse::<PublicKey>().is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        key.write(&path).unwrap();
        assert_eq!(SecretKey::read(&path).unwrap().public(), key.public());
        assert!(key.write(&path).is_err(), "never overwrites a key");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        }
    }
}
