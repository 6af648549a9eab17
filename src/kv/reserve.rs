//! Reserving a page file's blocks before it is mapped.
//!
//! Pages are written through a shared mapping of the file. A store into a
//! hole of a sparse file that the filesystem then cannot back (a full
//! disk, a quota) is not an error the writer can see: the kernel kills the
//! process with SIGBUS, with nothing logged. So every block of the file is
//! allocated when the pool is made, where running out of space is an error
//! that can be told and the server can refuse to start. Blocks the file
//! already has cost nothing, so a restart on a full disk whose page file
//! is whole still starts.

use std::fs::File;
use std::path::Path;

use super::error::KvError;

/// Makes sure `file` (`path`) has blocks for its first `len` bytes.
pub(super) fn reserve_blocks(file: &File, path: &Path, len: u64) -> Result<(), KvError> {
    allocate(file, path, len).map_err(|source| {
        let allocated = allocated_bytes(file);
        KvError::Reserve {
            path: path.to_owned(),
            bytes: len,
            needed: len.saturating_sub(allocated),
            free: crate::base::free_bytes(path.parent().unwrap_or(path)).ok(),
            source,
        }
    })
}

#[cfg(target_os = "linux")]
fn allocate(file: &File, _path: &Path, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len =
        libc::off_t::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    loop {
        // SAFETY: the descriptor is open for writing for as long as `file`
        // lives; posix_fallocate reads nothing else of ours.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
            0 => return Ok(()),
            libc::EINTR => continue,
            rc => return Err(std::io::Error::from_raw_os_error(rc)),
        }
    }
}

/// Elsewhere there is no portable way to allocate: the free space is only
/// checked against what the file lacks, which a later write can still
/// outrun.
#[cfg(not(target_os = "linux"))]
fn allocate(file: &File, path: &Path, len: u64) -> std::io::Result<()> {
    let lacking = len.saturating_sub(allocated_bytes(file));
    match crate::base::free_bytes(path.parent().unwrap_or(path)) {
        Ok(free) if free < lacking => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        _ => Ok(()),
    }
}

/// Bytes of `file` backed by blocks (0 when that cannot be said).
fn allocated_bytes(file: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata()
        .map_or(0, |m| m.blocks().saturating_mul(512))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_file_gets_every_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p");
        let file = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        file.set_len(1 << 20).unwrap();
        reserve_blocks(&file, &path, 1 << 20).unwrap();
        assert!(allocated_bytes(&file) >= 1 << 20);
        assert_eq!(file.metadata().unwrap().len(), 1 << 20);
    }
}
