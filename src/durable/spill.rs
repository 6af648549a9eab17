//! A spilled session's KV pages, written out so that its next call reads
//! them back instead of computing them again (`DIR/spill/ID.kv`).
//!
//! ```text
//! header  "INFERDS1" | layers u32 | page positions u32 | page bytes u32
//!         | blocks u32 | per block, per layer: present u8 | checksum u64
//!         | crc32c u32 (of everything before it)
//! pages   the present pages' bytes, block by block, layer by layer
//! ```
//!
//! The checksums are those of the kept page file (`pages.rs`): bound to the
//! page's bytes, its layer and the tokens up to its end. A page read back is
//! used only if it hashes to its checksum under the history the session has
//! now, so a file torn, damaged or left from another history costs a
//! recompute, never wrong bits. Only the blocks below the block of the
//! session's last token are written: that last page is always fed again.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::pages::{chain, first_seen_block, layer_seed, longest_run};
use crate::kv::SessionKv;

const MAGIC: &[u8; 8] = b"INFERDS1";
/// Bytes per table entry: a presence flag and a checksum.
const ENTRY: usize = 9;
/// Bytes of a file besides its table and pages: the fixed header and the
/// table's checksum.
const HEADER_BYTES: u64 = 28;

/// The most bytes a spill file of `pages` pages of `page_bytes` each can
/// take (every page written, each with its table entry): what a caller
/// claims against its limits before writing.
pub fn estimate(pages: usize, page_bytes: usize) -> u64 {
    (pages * (page_bytes + ENTRY)) as u64 + HEADER_BYTES
}

/// The blocks a session of `len` tokens can have written out or read back:
/// every full page below the page of its last token.
fn blocks_below_last(len: usize, page_positions: usize) -> usize {
    len.saturating_sub(1) / page_positions
}

/// Writes `kv`'s committed full pages (those below the last token's page)
/// to `path`. Returns the bytes written. Nothing is synced: the file only
/// saves a recompute.
pub fn write(path: &Path, kv: &SessionKv, history: &[u32]) -> std::io::Result<u64> {
    let layout = *kv.pool().layout();
    let page = layout.page_positions;
    let blocks = blocks_below_last(history.len().min(kv.len() + 1), page);
    let chain = chain(history, page, blocks);
    let page_bytes = layout.page_values() * 2;
    let mut header = Vec::with_capacity(28 + blocks * layout.n_layers * ENTRY);
    header.extend_from_slice(MAGIC);
    for v in [layout.n_layers, page, page_bytes, blocks] {
        header.extend_from_slice(&(v as u32).to_le_bytes());
    }
    let mut present = Vec::new();
    for (block, &link) in chain.iter().enumerate() {
        for layer in 0..layout.n_layers {
            match kv.page_bytes(block, layer) {
                Some(bytes) => {
                    header.push(1);
                    let sum = xxh3_64_with_seed(&bytes, layer_seed(link, layer));
                    header.extend_from_slice(&sum.to_le_bytes());
                    present.push(bytes);
                }
                None => {
                    header.push(0);
                    header.extend_from_slice(&0u64.to_le_bytes());
                }
            }
        }
    }
    let crc = crc32c::crc32c(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    // Private, and never through a link planted at the path.
    let file = super::private::options()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&header)?;
    for bytes in &present {
        out.write_all(&bytes[..])?;
    }
    out.flush()?;
    Ok((header.len() + present.len() * page_bytes) as u64)
}

/// Why a spill file was not read back (the session is computed instead).
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill file: {0}")]
    Io(#[from] std::io::Error),
    #[error("spill file is not for this layout or is damaged")]
    Misshapen,
    #[error("KV: {0}")]
    Kv(#[from] crate::kv::KvError),
}

/// Reads back what `path` holds of `history` into `kv`, from its committed
/// length (a page boundary: nothing, or mapped shared pages) on, into
/// pages already reserved for the history. Each page is checked against its
/// checksum first; the longest run of blocks that verifies (and gives every
/// window layer what its window reads there) is committed. Returns the
/// positions read back.
pub fn read(path: &Path, kv: &mut SessionKv, history: &[u32]) -> Result<usize, SpillError> {
    let layout = *kv.pool().layout();
    let page = layout.page_positions;
    let n_layers = layout.n_layers;
    let page_bytes = layout.page_values() * 2;
    let windows: Vec<Option<usize>> = (0..n_layers).map(|l| kv.pool().layer_window(l)).collect();
    let mut file = File::open(path)?;
    let mut head = [0u8; 24];
    file.read_exact(&mut head)?;
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if &head[..8] != MAGIC
        || word(8) as usize != n_layers
        || word(12) as usize != page
        || word(16) as usize != page_bytes
    {
        return Err(SpillError::Misshapen);
    }
    let file_blocks = word(20) as usize;
    // A spilled history does not change until it is read back: more blocks
    // than it has is damage, not a size to trust.
    if file_blocks > blocks_below_last(history.len(), page) {
        return Err(SpillError::Misshapen);
    }
    let mut table = vec![0u8; file_blocks * n_layers * ENTRY + 4];
    file.read_exact(&mut table)?;
    let (entries, crc) = table.split_at(table.len() - 4);
    let mut covered = head.to_vec();
    covered.extend_from_slice(entries);
    if crc32c::crc32c(&covered).to_le_bytes() != crc {
        return Err(SpillError::Misshapen);
    }
    let entry = |block: usize, layer: usize| -> Option<u64> {
        let at = (block * n_layers + layer) * ENTRY;
        (entries[at] == 1).then(|| {
            let mut sum = [0u8; 8];
            sum.copy_from_slice(&entries[at + 1..at + ENTRY]);
            u64::from_le_bytes(sum)
        })
    };
    let start = kv.len() / page;
    let most = blocks_below_last(history.len(), page).min(file_blocks);
    let first_seen = |blocks: usize, window: usize| first_seen_block(blocks * page, window, page);
    // The most blocks whose needed pages the file has.
    let usable = longest_run(start, most, &windows, page, |b, layer| {
        entry(b, layer).is_some()
    });
    if usable == start {
        return Ok(0);
    }
    let chain = chain(history, page, usable);
    let data_start = (24 + table.len()) as u64;
    // Pages are stored in table order, present ones only: where each is.
    let mut stored_before = Vec::with_capacity(file_blocks * n_layers);
    let mut count = 0usize;
    for i in 0..file_blocks * n_layers {
        stored_before.push(count);
        count += usize::from(entries[i * ENTRY] == 1);
    }
    let mut buf = vec![0u8; page_bytes];
    let mut loaded = start;
    'blocks: for block in start..usable {
        for layer in 0..n_layers {
            let needed = match windows[layer] {
                Some(w) => block >= first_seen(usable, w),
                None => true,
            };
            let Some(sum) = entry(block, layer) else {
                continue;
            };
            if !needed {
                continue;
            }
            let before = stored_before[block * n_layers + layer];
            file.seek(SeekFrom::Start(data_start + (before * page_bytes) as u64))?;
            file.read_exact(&mut buf)?;
            if xxh3_64_with_seed(&buf, layer_seed(chain[block], layer)) != sum {
                break 'blocks;
            }
            kv.load_page(block, layer, &buf)?;
        }
        loaded = block + 1;
    }
    // A shorter run than planned may leave a window layer short of what its
    // window reads at the end of it (it loaded only what `usable` needed):
    // keep only the run that holds up.
    let loaded = longest_run(start, loaded, &windows, page, |b, layer| {
        windows[layer].is_none_or(|w| b >= first_seen(usable, w) && entry(b, layer).is_some())
    });
    if loaded == start {
        return Ok(0);
    }
    kv.commit(loaded * page)?;
    // Pages of window layers the file did not keep hold nothing: give them
    // back before anything can read or list them.
    for (layer, window) in windows.iter().enumerate() {
        if let Some(w) = window {
            kv.give_back_before(layer, first_seen(loaded, *w))?;
        }
    }
    Ok((loaded - start) * page)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::kv::{KvLayout, KvPool, KvPoolConfig};

    const PAGE: usize = 4;
    const LAYERS: usize = 2;

    fn pool(windows: Option<Vec<Option<usize>>>) -> Arc<KvPool> {
        let pool = KvPool::new(KvPoolConfig::anonymous(
            KvLayout {
                n_layers: LAYERS,
                kv_dim: 8,
                page_positions: PAGE,
            },
            64,
        ))
        .expect("pool");
        Arc::new(match windows {
            Some(w) => pool
                .with_layer_windows(w)
                .expect("windows")
                .with_window_slack(PAGE),
            None => pool,
        })
    }

    fn value(history: &[u32], layer: usize, pos: usize) -> Vec<f32> {
        let sum: u32 = history[..=pos].iter().sum();
        (0..8)
            .map(|i| (sum + i) as f32 + layer as f32 * 0.5)
            .collect()
    }

    fn computed(pool: &Arc<KvPool>, history: &[u32]) -> SessionKv {
        let mut kv = SessionKv::new(Arc::clone(pool));
        kv.reserve(history.len()).unwrap();
        for pos in 0..history.len() {
            for layer in 0..LAYERS {
                let v = value(history, layer, pos);
                kv.write(layer, pos, &v, &v).unwrap();
            }
        }
        kv.commit(history.len()).unwrap();
        kv.settle().unwrap();
        kv
    }

    fn same_rows(a: &SessionKv, b: &SessionKv, positions: std::ops::Range<usize>, layer: usize) {
        for pos in positions {
            assert_eq!(
                a.k(layer, pos).unwrap(),
                b.k(layer, pos).unwrap(),
                "k {layer} {pos}"
            );
            assert_eq!(
                a.v(layer, pos).unwrap(),
                b.v(layer, pos).unwrap(),
                "v {layer} {pos}"
            );
        }
    }

    #[test]
    fn a_spill_file_is_private_and_a_link_at_its_path_is_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(None);
        let history: Vec<u32> = (0..19).map(|i| i * 7 + 3).collect();
        let source = computed(&pool, &history);
        // SAFETY: umask has no preconditions; 022 is the usual default.
        unsafe { libc::umask(0o022) };
        let path = dir.path().join("s.kv");
        write(&path, &source, &history).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("t.kv");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(write(&link, &source, &history).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn pages_written_out_come_back_to_the_bit_and_a_damaged_page_ends_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.kv");
        let pool = pool(None);
        let history: Vec<u32> = (0..19).map(|i| i * 7 + 3).collect();
        let source = computed(&pool, &history);
        let written = write(&path, &source, &history).unwrap();
        assert_eq!(written, std::fs::metadata(&path).unwrap().len());
        // Back into a fresh session: the 4 pages below the last token's.
        let mut back = SessionKv::new(Arc::clone(&pool));
        back.reserve(history.len()).unwrap();
        assert_eq!(read(&path, &mut back, &history).unwrap(), 16);
        assert_eq!(back.len(), 16);
        for layer in 0..LAYERS {
            same_rows(&source, &back, 0..16, layer);
        }
        // Another history (its third block differs) takes only what it shares.
        let mut other = history.clone();
        other[9] += 1;
        let mut back = SessionKv::new(Arc::clone(&pool));
        back.reserve(other.len()).unwrap();
        assert_eq!(read(&path, &mut back, &other).unwrap(), 8);
        // A flipped byte in block 1's second layer page: blocks 0 only.
        let mut bytes = std::fs::read(&path).unwrap();
        let page_bytes = 2 * PAGE * 8 * 2;
        let end = bytes.len();
        bytes[end - page_bytes * (2 * 4 - 3) + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mut back = SessionKv::new(Arc::clone(&pool));
        back.reserve(history.len()).unwrap();
        assert_eq!(read(&path, &mut back, &history).unwrap(), 4);
        // A damaged table is refused whole.
        bytes[30] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mut back = SessionKv::new(Arc::clone(&pool));
        back.reserve(history.len()).unwrap();
        assert!(matches!(
            read(&path, &mut back, &history),
            Err(SpillError::Misshapen)
        ));
        assert_eq!(back.len(), 0);
    }

    #[test]
    fn a_window_layer_gets_what_its_window_reads_and_gives_back_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.kv");
        let pool = pool(Some(vec![None, Some(6)]));
        let history: Vec<u32> = (0..30).map(|i| i * 5 + 1).collect();
        let source = computed(&pool, &history);
        write(&path, &source, &history).unwrap();
        let mut back = SessionKv::new(Arc::clone(&pool));
        back.reserve(history.len()).unwrap();
        // 29 / 4 = 7 blocks; the window reads from 28 + 1 - 6 = 23 on.
        assert_eq!(read(&path, &mut back, &history).unwrap(), 28);
        same_rows(&source, &back, 0..28, 0);
        same_rows(&source, &back, 23..28, 1);
        // Window pages before block 5 were given back at once.
        assert!(back.k(1, 19).is_err());
        drop((source, back));
        assert_eq!(pool.free_pages(), pool.total_pages());
    }
}
