//! A session's page hints and logits digests, in a file of their own beside
//! its journal (`DIR/sessions/ID.hints`). They are written without waiting
//! for the disk, so they must never sit between the journal's synced
//! records, where a power cut that kept a later block but not theirs would
//! read as damage in the middle and lose the whole history. Here a bad
//! record only ends what is read: everything from it on is ignored, and the
//! pages it described are computed again.
//!
//! ```text
//! header  "INFERDH1" | session id [16] | crc32c u32 (of both)
//! records framed as the journal's (journal.rs)
//! kinds   3 Pages: as in the journal
//!         5 Digest: history length u64 | history hash u64 | digest u64
//! ```
//!
//! A digest names the history it is of (its length and an xxh3 of its
//! tokens), since nothing here is ordered with the journal's records.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::journal::{
    decode_hints, encode_hints, hints_bytes, next_record, seal_record, start_record, NextRecord,
    PageHint, PageHints, Reader,
};

/// The first bytes of every hints file.
const MAGIC: &[u8; 8] = b"INFERDH1";
const KIND_PAGES: u8 = 3;
const KIND_DIGEST: u8 = 5;

/// A hash of a history's tokens that a digest is bound to.
pub fn history_hash(history: &[u32]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(history))
}

/// What a hints file says, read up to its first bad record.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Hinted {
    /// Page hints from block 0, in block order.
    pub hints: Vec<Box<[PageHint]>>,
    /// The last digest recorded: (history length, history hash, digest).
    pub digest: Option<(u64, u64, u64)>,
}

impl Hinted {
    /// The digest if it is of `history`.
    pub fn digest_of(&self, history: &[u32]) -> Option<u64> {
        self.digest
            .filter(|&(len, hash, _)| len == history.len() as u64 && hash == history_hash(history))
            .map(|(_, _, digest)| digest)
    }
}

fn header(session: &[u8; 16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(28);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(session);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads a hints file of `session`. A foreign or damaged header gives
/// nothing; a bad record ends the reading.
pub fn read(bytes: &[u8], session: &[u8; 16]) -> Hinted {
    let mut got = Hinted::default();
    let head = header(session);
    if bytes.get(..head.len()) != Some(head.as_slice()) {
        return got;
    }
    let mut r = Reader::new(bytes);
    r.at = head.len();
    while let NextRecord::Record(kind, payload) = next_record(&mut r) {
        let mut p = Reader::new(payload);
        match kind {
            KIND_PAGES => {
                let Some(run) = decode_hints(&mut p) else {
                    break;
                };
                // A run that starts past the hints held leaves a gap: the
                // blocks after it could never be adopted.
                let first = run.first_block as usize;
                if first <= got.hints.len() {
                    got.hints.truncate(first);
                    got.hints.extend(run.blocks);
                }
            }
            KIND_DIGEST => match (p.u64(), p.u64(), p.u64()) {
                (Some(len), Some(hash), Some(digest)) if p.at == payload.len() => {
                    got.digest = Some((len, hash, digest));
                }
                _ => break,
            },
            _ => break,
        }
    }
    got
}

/// The hints file of one session: opened for each write and closed after,
/// so that it holds no descriptor between calls.
#[derive(Debug)]
pub struct HintsFile {
    path: PathBuf,
    session: [u8; 16],
    /// Bytes written since it was last started over (what it weighs).
    len: u64,
    scratch: Vec<u8>,
}

impl HintsFile {
    /// The hints file at `path`, holding `len` bytes already.
    pub fn new(path: PathBuf, session: [u8; 16], len: u64) -> Self {
        HintsFile {
            path,
            session,
            len,
            scratch: Vec::new(),
        }
    }

    /// Bytes in the file.
    pub fn file_bytes(&self) -> u64 {
        self.len
    }

    /// Records where full pages of the history lie.
    pub fn pages(&mut self, hints: &PageHints) -> std::io::Result<()> {
        let mut out = std::mem::take(&mut self.scratch);
        start_record(&mut out, KIND_PAGES, hints_bytes(hints));
        encode_hints(&mut out, hints);
        seal_record(&mut out);
        let written = self.write(&out);
        self.scratch = out;
        written
    }

    /// Records the logits digest of `history`.
    pub fn digest(&mut self, history: &[u32], digest: u64) -> std::io::Result<()> {
        let mut out = std::mem::take(&mut self.scratch);
        start_record(&mut out, KIND_DIGEST, 24);
        out.extend_from_slice(&(history.len() as u64).to_le_bytes());
        out.extend_from_slice(&history_hash(history).to_le_bytes());
        out.extend_from_slice(&digest.to_le_bytes());
        seal_record(&mut out);
        let written = self.write(&out);
        self.scratch = out;
        written
    }

    /// Throws every hint away (they describe a history that changed, or
    /// have piled up): the next ones start a new file.
    pub fn clear(&mut self) {
        self.len = 0;
        let _ = std::fs::remove_file(&self.path);
    }

    fn write(&mut self, record: &[u8]) -> std::io::Result<()> {
        let mut file = open_append(&self.path)?;
        let fresh = self.len == 0 || file.metadata()?.len() == 0;
        let written = if fresh {
            file.set_len(0)?;
            let mut bytes = header(&self.session);
            bytes.extend_from_slice(record);
            file.write_all(&bytes).map(|()| bytes.len())
        } else {
            file.write_all(record).map(|()| record.len())
        };
        match written {
            Ok(n) => {
                self.len = if fresh { n as u64 } else { self.len + n as u64 };
                Ok(())
            }
            Err(e) => {
                // A half-written record would end every later read there.
                self.clear();
                Err(e)
            }
        }
    }
}

/// Opens `path` to append, creating it readable by its owner alone and
/// never through a symbolic link.
fn open_append(path: &Path) -> std::io::Result<File> {
    super::private::options()
        .create(true)
        .append(true)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(first_block: u32, pages: &[u32]) -> PageHints {
        PageHints {
            first_block,
            n_layers: 1,
            blocks: pages
                .iter()
                .map(|&page| {
                    [PageHint {
                        page,
                        checksum: u64::from(page) * 3,
                    }]
                    .into()
                })
                .collect(),
        }
    }

    #[test]
    fn hints_and_digests_come_back_and_a_bad_record_ends_the_reading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.hints");
        let session = [4; 16];
        let mut file = HintsFile::new(path.clone(), session, 0);
        file.pages(&run(0, &[10, 11])).unwrap();
        file.digest(&[1, 2, 3], 99).unwrap();
        file.pages(&run(1, &[20, 21])).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(file.file_bytes(), bytes.len() as u64);
        let got = read(&bytes, &session);
        assert_eq!(got.hints, run(0, &[10, 20, 21]).blocks);
        assert_eq!(got.digest_of(&[1, 2, 3]), Some(99));
        assert_eq!(got.digest_of(&[1, 2, 4]), None);
        assert_eq!(got.digest_of(&[1, 2]), None);
        // Another session's file, or a damaged header: nothing.
        assert_eq!(read(&bytes, &[5; 16]), Hinted::default());
        let mut bad = bytes.clone();
        bad[3] ^= 1;
        assert_eq!(read(&bad, &session), Hinted::default());
        // Damage in the last record keeps what came before it.
        let mut bad = bytes.clone();
        let end = bad.len();
        bad[end - 2] ^= 1;
        let got = read(&bad, &session);
        assert_eq!(got.hints, run(0, &[10, 11]).blocks);
        assert_eq!(got.digest_of(&[1, 2, 3]), Some(99));
        // Cleared, the next record starts a new file.
        file.clear();
        assert!(!path.exists());
        file.digest(&[7], 5).unwrap();
        let got = read(&std::fs::read(&path).unwrap(), &session);
        assert_eq!((got.hints.len(), got.digest_of(&[7])), (0, Some(5)));
    }
}
