//! The model fingerprint a shard and its coordinator must agree on: the
//! SHA-256 of the whole GGUF file plus the layer range the shard runs.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub gguf_sha256: [u8; 32],
    pub layer_begin: u32,
    pub layer_end: u32,
    pub layer_count: u32,
    pub hidden_size: u32,
}

impl Fingerprint {
    /// The fingerprint of `layers` of the model `config` describes, whose
    /// GGUF hashes to `gguf_sha256`.
    pub fn of_layers(
        gguf_sha256: [u8; 32],
        config: &crate::model::ModelConfig,
        layers: std::ops::Range<usize>,
    ) -> Fingerprint {
        Fingerprint {
            gguf_sha256,
            layer_begin: layers.start as u32,
            layer_end: layers.end as u32,
            layer_count: config.n_layers as u32,
            hidden_size: config.hidden as u32,
        }
    }
}

/// SHA-256 of a file, read in 1 MiB pieces.
pub fn sha256_of_file(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hasher.finalize().into())
}

impl Fingerprint {
    /// The wire message.
    pub fn to_wire(&self) -> pb::ModelFingerprint {
        let mut m = pb::ModelFingerprint::new();
        m.set_gguf_sha256(self.gguf_sha256.to_vec());
        m.set_layer_begin(self.layer_begin);
        m.set_layer_end(self.layer_end);
        m.set_layer_count(self.layer_count);
        m.set_hidden_size(self.hidden_size);
        m
    }

    /// From the wire; `None` when the hash is not 32 bytes or the range is
    /// empty or outside the model.
    pub fn from_wire(m: &pb::ModelFingerprint) -> Option<Self> {
        let gguf_sha256 = <[u8; 32]>::try_from(m.get_gguf_sha256()).ok()?;
        let valid = m.get_layer_begin() < m.get_layer_end()
            && m.get_layer_end() <= m.get_layer_count()
            && m.get_hidden_size() > 0;
        valid.then(|| Fingerprint {
            gguf_sha256,
            layer_begin: m.get_layer_begin(),
            layer_end: m.get_layer_end(),
            layer_count: m.get_layer_count(),
            hidden_size: m.get_hidden_size(),
        })
    }

    /// The hash as lowercase hex, for messages.
    pub fn hash_hex(&self) -> String {
        self.gguf_sha256
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_hash_is_sha256() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").unwrap();
        let hash = sha256_of_file(&path).unwrap();
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn the_wire_form_round_trips_and_bad_ranges_are_refused() {
        let f = Fingerprint {
            gguf_sha256: [7; 32],
            layer_begin: 10,
            layer_end: 20,
            layer_count: 30,
            hidden_size: 576,
        };
        assert_eq!(Fingerprint::from_wire(&f.to_wire()), Some(f.clone()));
        for (begin, end) in [(20, 10), (10, 10), (10, 31)] {
            let mut m = f.to_wire();
            m.set_layer_begin(begin);
            m.set_layer_end(end);
            assert_eq!(Fingerprint::from_wire(&m), None, "{begin}..{end}");
        }
        let mut short = f.to_wire();
        short.set_gguf_sha256(vec![1; 31]);
        assert_eq!(Fingerprint::from_wire(&short), None);
    }
}
