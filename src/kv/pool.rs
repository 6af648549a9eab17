//! The KV slab pool: one memory map carved into fixed-size pages, with the
//! lock-free [`PageAllocator`] deciding who owns which page.
//!
//! # Page layout
//!
//! A page holds the K and V rows of one layer for `page_positions`
//! consecutive positions, as f16:
//!
//! ```text
//! page = [K, V][slot 0 .. page_positions][kv_dim] f16
//! element offset of (kind, slot) = (kind * page_positions + slot) * kv_dim
//! ```
//!
//! `kv_dim` is `n_kv_heads * head_dim`. So the K rows of one layer for the
//! positions of one page are contiguous, which is what attention reads, and
//! a sliding-window layer can give back the pages its window has left
//! behind while the other layers keep theirs. The page stride is the page
//! size rounded up to a 64-byte cache line, so every page starts
//! cache-aligned; for the reference model (kv_dim 192, 16 positions) a page
//! is 12,288 bytes and needs no padding.
//!
//! The pool never creates a reference to the map as a whole; sessions build
//! slices of the pages they own from raw pointers (see `session.rs`).

use std::fs::OpenOptions;
use std::path::PathBuf;

use memmap2::{MmapMut, MmapOptions, MmapRaw};

use std::sync::Arc;

use super::alloc::{PageAllocator, MAX_PAGES};
use super::device::PageStore;
use super::error::KvError;

/// Bytes per f16 value.
const F16_BYTES: usize = 2;
/// Pages start on this boundary inside the map.
const PAGE_ALIGN: usize = 64;
/// Prefaulting touches one byte per this many bytes.
const OS_PAGE: usize = 4096;

/// Positions per page used when a caller has no reason to pick another:
/// small enough that a session wastes little at its tail, large enough that
/// attention reads long contiguous runs.
pub const DEFAULT_PAGE_POSITIONS: usize = 16;

/// The shape of the cached tensors: what one position costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers, each with its own K and V (and its own pages).
    pub n_layers: usize,
    /// Values per K (and per V) row: `n_kv_heads * head_dim`.
    pub kv_dim: usize,
    /// Positions per page; a power of two so position arithmetic is shifts.
    pub page_positions: usize,
}

impl KvLayout {
    /// Check that the layout is usable and its sizes do not overflow.
    pub fn validate(&self) -> Result<(), KvError> {
        let invalid = |reason: String| Err(KvError::InvalidConfig { reason });
        if self.n_layers == 0 {
            return invalid("n_layers is 0".to_string());
        }
        if self.kv_dim == 0 {
            return invalid("kv_dim is 0".to_string());
        }
        if !self.page_positions.is_power_of_two() {
            return invalid(format!(
                "page_positions is {}; it must be a power of two",
                self.page_positions
            ));
        }
        if self.checked_page_stride().is_none() {
            return invalid(format!(
                "a page of {} positions x kv_dim {} overflows",
                self.page_positions, self.kv_dim
            ));
        }
        Ok(())
    }

    /// Bytes one position takes across all layers, K and V:
    /// `n_layers * 2 * kv_dim * 2`.
    pub fn bytes_per_position(&self) -> usize {
        self.n_layers * 2 * self.kv_dim * F16_BYTES
    }

    /// f16 values in one page (without padding).
    pub fn page_values(&self) -> usize {
        2 * self.page_positions * self.kv_dim
    }

    /// Pages that back `positions` positions of every layer.
    pub fn pages_for_positions(&self, positions: usize) -> usize {
        positions
            .div_ceil(self.page_positions)
            .saturating_mul(self.n_layers)
    }

    fn checked_page_stride(&self) -> Option<usize> {
        let bytes = 2usize
            .checked_mul(self.page_positions)?
            .checked_mul(self.kv_dim)?
            .checked_mul(F16_BYTES)?;
        bytes.checked_next_multiple_of(PAGE_ALIGN)
    }

    /// Bytes between the starts of consecutive pages (page size rounded up
    /// to a cache line). Only meaningful for a validated layout.
    pub fn page_stride(&self) -> usize {
        self.checked_page_stride().unwrap_or(usize::MAX)
    }
}

/// Where the pool's memory comes from.
#[derive(Debug, Clone)]
pub enum KvBacking {
    /// Anonymous memory (the default).
    Anonymous,
    /// A file, created or truncated and sized to the pool. Nothing else may
    /// touch the file while the pool lives.
    File(PathBuf),
    /// A file kept across runs (the state directory's page file): created
    /// when missing, otherwise opened as it is and sized to the pool, so its
    /// pages hold what the last run wrote until they are handed out again.
    /// Nothing else may touch the file while the pool lives.
    Kept(PathBuf),
    /// Outside this process (a GPU's memory): nothing is mapped here, and
    /// the store moves page bytes when the pool must (fork, spill, restore).
    Device(Arc<dyn PageStore>),
}

impl PartialEq for KvBacking {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Anonymous, Self::Anonymous) => true,
            (Self::File(a), Self::File(b)) | (Self::Kept(a), Self::Kept(b)) => a == b,
            (Self::Device(a), Self::Device(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for KvBacking {}

/// Everything needed to build a [`KvPool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPoolConfig {
    /// The shape of one position.
    pub layout: KvLayout,
    /// Pages in the pool.
    pub n_pages: usize,
    /// Where the memory comes from.
    pub backing: KvBacking,
    /// Touch every page at start-up so no decode step pays for first-touch
    /// page faults (slow on virtual machines). Costs start-up time and
    /// commits the memory at once.
    pub prefault: bool,
}

impl KvPoolConfig {
    /// Anonymous memory, prefaulted.
    pub fn anonymous(layout: KvLayout, n_pages: usize) -> Self {
        KvPoolConfig {
            layout,
            n_pages,
            backing: KvBacking::Anonymous,
            prefault: true,
        }
    }
}

/// The shared pool of KV pages. Shared between threads as `Arc<KvPool>`;
/// each page is owned by at most one [`SessionKv`](super::SessionKv) at a
/// time, as decided by the allocator.
pub struct KvPool {
    layout: KvLayout,
    page_stride: usize,
    /// The pages' memory; `None` for a ledger, whose pages hold nothing,
    /// and for pages on a device.
    map: Option<MmapRaw>,
    /// Where the pages are when they are on a device.
    store: Option<Arc<dyn PageStore>>,
    allocator: PageAllocator,
    backing: KvBacking,
    /// Per layer, the sliding window it attends over (`None`: every
    /// position); empty when no layer has one.
    layer_windows: Box<[Option<usize>]>,
    /// Positions a window layer keeps before its window (see
    /// [`KvPool::with_window_slack`]).
    window_slack: usize,
}

impl KvPool {
    /// Map the memory and put every page on the free list.
    pub fn new(config: KvPoolConfig) -> Result<Self, KvError> {
        let KvPoolConfig {
            layout,
            n_pages,
            backing,
            prefault,
        } = config;
        layout.validate()?;
        check_page_count(n_pages)?;
        let page_stride = layout.page_stride();
        if let KvBacking::Device(store) = &backing {
            return Ok(KvPool {
                layout,
                page_stride,
                map: None,
                store: Some(Arc::clone(store)),
                allocator: PageAllocator::new(n_pages)?,
                backing,
                layer_windows: Box::new([]),
                window_slack: 0,
            });
        }
        let total_bytes =
            page_stride
                .checked_mul(n_pages)
                .ok_or_else(|| KvError::InvalidConfig {
                    reason: format!(
                        "{n_pages} pages of {page_stride} bytes overflow the address space"
                    ),
                })?;
        let mut map = map_backing(&backing, total_bytes)?;
        advise_huge_pages(&map);
        if prefault {
            // Before any page is handed out, the map is ours alone.
            for offset in (0..total_bytes).step_by(OS_PAGE) {
                map[offset] = 0;
            }
        }
        Ok(KvPool {
            layout,
            page_stride,
            map: Some(MmapRaw::from(map)),
            store: None,
            allocator: PageAllocator::new(n_pages)?,
            backing,
            layer_windows: Box::new([]),
            window_slack: 0,
        })
    }

    /// A pool that only counts: `n_pages` pages of `page_positions`
    /// positions for `n_layers` layers whose K and V live elsewhere (a
    /// coordinator's shards). Sessions reserve, commit, settle and release
    /// its pages exactly as in a pool that holds rows, so admission and
    /// eviction work the same; it maps no memory, and reading or writing a
    /// row of it is [`KvError::NoStorage`].
    pub fn ledger(n_layers: usize, page_positions: usize, n_pages: usize) -> Result<Self, KvError> {
        // Rows of no values: the layout's checks of n_layers and
        // page_positions apply, its kv_dim check does not.
        let layout = KvLayout {
            n_layers,
            kv_dim: 0,
            page_positions,
        };
        KvLayout {
            kv_dim: 1,
            ..layout
        }
        .validate()?;
        check_page_count(n_pages)?;
        Ok(KvPool {
            layout,
            page_stride: 0,
            map: None,
            store: None,
            allocator: PageAllocator::new(n_pages)?,
            backing: KvBacking::Anonymous,
            layer_windows: Box::new([]),
            window_slack: 0,
        })
    }

    /// Whether the pages hold K and V rows (false for a [`KvPool::ledger`]).
    pub fn holds_rows(&self) -> bool {
        self.map.is_some() || self.store.is_some()
    }

    /// Whether the pages are in this process's memory (false for a ledger
    /// and for pages on a device).
    pub fn maps_rows(&self) -> bool {
        self.map.is_some()
    }

    /// The device store, when the pages live on one.
    pub fn device_store(&self) -> Option<&Arc<dyn PageStore>> {
        self.store.as_ref()
    }

    /// Says which layers attend over a sliding window of positions, one
    /// entry per layer (`None`: all positions), so sessions can give back
    /// the pages those layers no longer see ([`SessionKv::settle`]).
    ///
    /// [`SessionKv::settle`]: super::SessionKv::settle
    pub fn with_layer_windows(mut self, windows: Vec<Option<usize>>) -> Result<Self, KvError> {
        if windows.len() != self.layout.n_layers {
            return Err(KvError::InvalidConfig {
                reason: format!(
                    "{} layer windows for {} layers",
                    windows.len(),
                    self.layout.n_layers
                ),
            });
        }
        if windows.contains(&Some(0)) {
            return Err(KvError::InvalidConfig {
                reason: "a sliding window of 0 positions".to_string(),
            });
        }
        self.layer_windows = if windows.iter().all(Option::is_none) {
            Box::new([])
        } else {
            windows.into_boxed_slice()
        };
        Ok(self)
    }

    /// Has window layers keep `positions` more positions than their window
    /// reads: a restart that feeds a session's last page again (its pages
    /// kept in the state directory) reads that far back.
    pub fn with_window_slack(mut self, positions: usize) -> Self {
        self.window_slack = positions;
        self
    }

    /// Positions a window layer keeps before what its window reads.
    pub fn window_slack(&self) -> usize {
        self.window_slack
    }

    /// The sliding window `layer` attends over (`None`: every position).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.layer_windows.get(layer).copied().flatten()
    }

    /// Per layer, its sliding window; empty when every layer sees every
    /// position.
    pub fn layer_windows(&self) -> &[Option<usize>] {
        &self.layer_windows
    }

    /// How many pages of `layout` fit in `bytes` of memory, in whole pages
    /// of positions (a page for every layer): a multiple of `n_layers`.
    pub fn pages_for_bytes(layout: &KvLayout, bytes: u64) -> usize {
        let layers = layout.n_layers.max(1);
        let stride = layout.page_stride() as u64;
        let pages = bytes.checked_div(stride).unwrap_or(0);
        let pages = usize::try_from(pages).unwrap_or(usize::MAX).min(MAX_PAGES);
        pages - pages % layers
    }

    /// The shape of one position.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Bytes each page occupies in the map (page size rounded up to a cache
    /// line).
    pub fn page_bytes(&self) -> usize {
        self.page_stride
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.allocator.total()
    }

    /// Pages free right now (exact when no other thread is allocating).
    pub fn free_pages(&self) -> usize {
        self.allocator.free_count()
    }

    /// Bytes one position takes across all layers, K and V (before any
    /// window gives pages back).
    pub fn bytes_per_position(&self) -> usize {
        self.layout.bytes_per_position()
    }

    /// Bytes of the whole map (0 for a ledger).
    pub fn mapped_bytes(&self) -> usize {
        self.map.as_ref().map_or(0, MmapRaw::len)
    }

    /// Where the memory comes from.
    pub fn backing(&self) -> &KvBacking {
        &self.backing
    }

    /// The allocator, for callers that manage raw page indices.
    pub fn allocator(&self) -> &PageAllocator {
        &self.allocator
    }

    /// The checksum of page `page`'s K and V (padding excluded) under
    /// `seed`, or `None` for a ledger or an index the pool does not have.
    /// `&mut self` proves that no session holds the pool yet, so no page is
    /// being written: this is for reading back a kept page file at start.
    pub fn checksum_unheld_page(&mut self, page: u32, seed: u64) -> Option<u64> {
        self.checksum_page(page, seed)
    }

    /// The checksum of a page the caller holds and nobody writes (a full
    /// page of a committed history).
    pub(super) fn checksum_page(&self, page: u32, seed: u64) -> Option<u64> {
        if let Some(store) = &self.store {
            let mut bytes = vec![0u8; self.layout.page_values() * F16_BYTES];
            if page as usize >= self.allocator.total() || store.read(page, &mut bytes).is_err() {
                return None;
            }
            return Some(xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed));
        }
        let start = self.page_ptr(page)?;
        let bytes = self.layout.page_values() * F16_BYTES;
        // SAFETY: `page_ptr` is valid for `page_stride >= bytes` bytes; the
        // callers guarantee that no thread writes the page meanwhile.
        let page_bytes = unsafe { std::slice::from_raw_parts(start.cast_const(), bytes) };
        Some(xxhash_rust::xxh3::xxh3_64_with_seed(page_bytes, seed))
    }

    /// Rebuilds the allocator so that page `i` has `refs[i]` holders (one
    /// entry per page): the pages a restart verified in a kept page file and
    /// hands to the sessions it restores. Only while no page is handed out.
    pub fn claim_pages(&mut self, refs: &[u32]) -> Result<(), KvError> {
        if refs.len() != self.allocator.total() {
            return Err(KvError::InvalidConfig {
                reason: format!(
                    "{} page references for a pool of {} pages",
                    refs.len(),
                    self.allocator.total()
                ),
            });
        }
        if self.allocator.free_count() != self.allocator.total() {
            return Err(KvError::InvalidConfig {
                reason: "pages are claimed only before any is handed out".to_string(),
            });
        }
        self.allocator = PageAllocator::with_references(refs)?;
        Ok(())
    }

    /// Copies page `from` over page `to` (both held by the caller, `to`
    /// alone). A ledger has nothing to copy.
    pub(super) fn copy_page(&self, from: u32, to: u32) -> Result<(), KvError> {
        if let Some(store) = &self.store {
            return store.copy(from, to);
        }
        if !self.holds_rows() {
            return Ok(());
        }
        let missing = |page| KvError::AllocatorCorrupted {
            detail: format!("page {page} is not in the pool"),
        };
        let src = self.page_ptr(from).ok_or_else(|| missing(from))?;
        let dst = self.page_ptr(to).ok_or_else(|| missing(to))?;
        if src != dst {
            // SAFETY: both pointers are page starts inside the map, valid
            // for `page_bytes()` bytes; distinct pages do not overlap; the
            // caller holds `to` alone, so nothing else reads or writes it.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, self.page_stride) };
        }
        Ok(())
    }

    /// Start of page `page`, or `None` for an index the pool does not have.
    /// The pointer is valid for `page_bytes()` bytes and aligned to 64.
    #[inline]
    pub(super) fn page_ptr(&self, page: u32) -> Option<*mut u8> {
        let map = self.map.as_ref()?;
        let page = page as usize;
        if page >= self.allocator.total() {
            return None;
        }
        // SAFETY: `page < total` so `page * page_stride + page_stride` is at
        // most the map length, which did not overflow when it was computed;
        // the offset pointer therefore stays inside the mapping.
        Some(unsafe { map.as_mut_ptr().add(page * self.page_stride) })
    }
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("layout", &self.layout)
            .field("page_bytes", &self.page_stride)
            .field("total_pages", &self.total_pages())
            .field("free_pages", &self.free_pages())
            .field("backing", &self.backing)
            .finish()
    }
}

/// A pool has at least one page and at most what the allocator indexes.
fn check_page_count(n_pages: usize) -> Result<(), KvError> {
    if n_pages == 0 || n_pages > MAX_PAGES {
        return Err(KvError::InvalidConfig {
            reason: format!("n_pages is {n_pages}; it must be between 1 and {MAX_PAGES}"),
        });
    }
    Ok(())
}

fn map_backing(backing: &KvBacking, total_bytes: usize) -> Result<MmapMut, KvError> {
    let map_error = |path: Option<PathBuf>| {
        move |source: std::io::Error| KvError::Map {
            bytes: total_bytes as u64,
            path,
            source,
        }
    };
    match backing {
        KvBacking::Anonymous => MmapOptions::new()
            .len(total_bytes)
            .map_anon()
            .map_err(map_error(None)),
        KvBacking::Device(_) => Err(KvError::NoStorage),
        KvBacking::File(path) | KvBacking::Kept(path) => {
            #[cfg(not(loom))]
            let existed = path.exists();
            let mut options = OpenOptions::new();
            // Only this user may read the pages (they are the sessions'
            // KV), and a link planted at the path is not followed.
            #[cfg(not(loom))]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600).custom_flags(libc::O_NOFOLLOW);
            }
            let file = options
                .read(true)
                .write(true)
                .create(true)
                .truncate(matches!(backing, KvBacking::File(_)))
                .open(path)
                .map_err(map_error(Some(path.clone())))?;
            // A file an earlier version left readable by others is made
            // private too.
            #[cfg(not(loom))]
            {
                use std::os::unix::fs::PermissionsExt;
                let meta = file.metadata().map_err(map_error(Some(path.clone())))?;
                if meta.permissions().mode() & 0o077 != 0 {
                    file.set_permissions(std::fs::Permissions::from_mode(0o600))
                        .map_err(map_error(Some(path.clone())))?;
                }
            }
            file.set_len(total_bytes as u64)
                .map_err(map_error(Some(path.clone())))?;
            // Every block now, so that no write through the map can find
            // the disk full (SIGBUS).
            #[cfg(not(loom))]
            if let Err(e) = super::reserve::reserve_blocks(&file, path, total_bytes as u64) {
                if !existed {
                    let _ = std::fs::remove_file(path);
                }
                return Err(e);
            }
            // SAFETY: the file was just sized by us; the documented contract
            // of `KvBacking::File` and `KvBacking::Kept` is that nothing else
            // modifies or truncates it while the pool lives, so the mapping
            // stays valid and only this process writes it.
            unsafe { MmapOptions::new().len(total_bytes).map_mut(&file) }
                .map_err(map_error(Some(path.clone())))
        }
    }
}

/// Ask for transparent huge pages: fewer TLB misses when attention walks
/// every page of a long session. Only a hint, so a refusal is ignored.
#[cfg(target_os = "linux")]
fn advise_huge_pages(map: &MmapMut) {
    if let Err(err) = map.advise(memmap2::Advice::HugePage) {
        tracing::debug!("KV pool: huge-page advice refused: {err}");
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_map: &MmapMut) {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn smol_layout() -> KvLayout {
        KvLayout {
            n_layers: 30,
            kv_dim: 192,
            page_positions: DEFAULT_PAGE_POSITIONS,
        }
    }

    #[test]
    fn reference_model_sizes() {
        let layout = smol_layout();
        assert_eq!(layout.bytes_per_position(), 23_040);
        assert_eq!(layout.page_stride(), 23_040 * 16 / 30);
        assert_eq!(layout.pages_for_positions(17), 60);
        let pool = KvPool::new(KvPoolConfig::anonymous(layout, 3)).unwrap();
        assert_eq!(pool.page_bytes(), 12_288);
        assert_eq!(pool.mapped_bytes(), 3 * 12_288);
        assert_eq!(pool.total_pages(), 3);
        assert_eq!(pool.free_pages(), 3);
        assert_eq!(pool.bytes_per_position(), 23_040);
    }

    #[test]
    fn odd_page_sizes_are_padded_to_a_cache_line() {
        let layout = KvLayout {
            n_layers: 1,
            kv_dim: 3,
            page_positions: 2,
        };
        assert_eq!(layout.page_values(), 12);
        assert_eq!(layout.page_stride(), 64);
        let pool = KvPool::new(KvPoolConfig::anonymous(layout, 5)).unwrap();
        let first = pool.page_ptr(0).unwrap() as usize;
        let second = pool.page_ptr(1).unwrap() as usize;
        assert_eq!(second - first, 64);
        assert_eq!(first % 64, 0);
        assert!(pool.page_ptr(5).is_none());
    }

    #[test]
    fn bad_configs_are_rejected_with_reasons() {
        let mut layout = smol_layout();
        layout.page_positions = 12;
        let err = KvPool::new(KvPoolConfig::anonymous(layout, 1)).unwrap_err();
        assert!(err.to_string().contains("page_positions is 12"), "{err}");

        let err = KvPool::new(KvPoolConfig::anonymous(smol_layout(), 0)).unwrap_err();
        assert!(err.to_string().contains("n_pages is 0"), "{err}");

        let huge = KvLayout {
            n_layers: 2,
            kv_dim: usize::MAX / 8,
            page_positions: 4,
        };
        assert!(matches!(
            huge.validate(),
            Err(KvError::InvalidConfig { .. })
        ));

        let zero_dim = KvLayout {
            kv_dim: 0,
            ..smol_layout()
        };
        assert!(zero_dim.validate().is_err());
    }

    #[test]
    fn pages_for_bytes_rounds_down() {
        let layout = smol_layout();
        assert_eq!(KvPool::pages_for_bytes(&layout, 0), 0);
        assert_eq!(KvPool::pages_for_bytes(&layout, 12_288 * 29), 0);
        assert_eq!(KvPool::pages_for_bytes(&layout, 368_640 * 10 + 5), 300);
        assert_eq!(KvPool::pages_for_bytes(&layout, 368_640 * 11 - 1), 300);
        assert_eq!(
            KvPool::pages_for_bytes(&layout, u64::MAX),
            MAX_PAGES - MAX_PAGES % 30
        );
    }

    #[test]
    fn file_backed_pool_is_sized_and_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.slab");
        std::fs::write(&path, vec![7u8; 10]).unwrap();
        let layout = KvLayout {
            n_layers: 2,
            kv_dim: 8,
            page_positions: 4,
        };
        let config = KvPoolConfig {
            layout,
            n_pages: 4,
            backing: KvBacking::File(path.clone()),
            prefault: false,
        };
        let pool = KvPool::new(config).unwrap();
        assert_eq!(pool.page_bytes(), 128);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 * 128);
        let contents = std::fs::read(&path).unwrap();
        assert!(
            contents.iter().all(|&b| b == 0),
            "old file contents survived"
        );
        assert_eq!(pool.backing(), &KvBacking::File(path));
    }

    #[test]
    fn unmappable_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("kv.slab");
        let config = KvPoolConfig {
            layout: smol_layout(),
            n_pages: 1,
            backing: KvBacking::File(path),
            prefault: true,
        };
        let err = KvPool::new(config).unwrap_err();
        assert!(matches!(err, KvError::Map { bytes: 12_288, .. }));
        assert!(err.to_string().contains("kv.slab"), "{err}");
    }

    #[test]
    fn a_kept_page_file_is_private_whole_on_disk_and_never_a_link() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let layout = KvLayout {
            n_layers: 2,
            kv_dim: 8,
            page_positions: 4,
        };
        let config = |path: &std::path::Path| KvPoolConfig {
            layout,
            n_pages: 64,
            backing: KvBacking::Kept(path.to_owned()),
            prefault: false,
        };
        let path = dir.path().join("kv.pages");
        // A file an earlier version left readable by others.
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(KvPool::new(config(&path)).unwrap());
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 64 * 128);
        assert!(meta.blocks() * 512 >= 64 * 128, "every block is allocated");
        // A link planted where the page file goes is not written through.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("linked.pages");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = KvPool::new(config(&link)).unwrap_err();
        assert!(matches!(err, KvError::Map { .. }), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn layer_windows_are_checked_against_the_layout() {
        let pool = || KvPool::new(KvPoolConfig::anonymous(smol_layout(), 1)).unwrap();
        let err = pool().with_layer_windows(vec![Some(4); 29]).unwrap_err();
        assert!(err.to_string().contains("29 layer windows for 30"), "{err}");
        let mut windows = vec![None; 30];
        windows[3] = Some(0);
        assert!(pool().with_layer_windows(windows.clone()).is_err());
        windows[3] = Some(512);
        assert_eq!(
            pool().with_layer_windows(windows).unwrap().layer_windows()[3],
            Some(512)
        );
        let none = pool().with_layer_windows(vec![None; 30]).unwrap();
        assert!(none.layer_windows().is_empty());
    }

    #[test]
    fn pool_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<KvPool>();
    }
}
