//! Who may read and write a state directory: the user the server runs as,
//! and no one else, whatever the umask it was started with.
//!
//! A journal's file name is a session id, which alone lets a client go on
//! with the session, and its bytes are the session's history; the page
//! and spill files hold its KV. So directories are made `0700` and files
//! `0600` here rather than left to the service manager's `UMask=`, and a
//! directory another user owns or may write is refused, as ssh and
//! PostgreSQL refuse theirs: whoever can write it can plant files (or
//! symbolic links that redirect our writes) before we open them. Files are
//! opened with `O_NOFOLLOW` all the same, so a link found where a file
//! should be is an error, never a write somewhere else.

use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Mode of every directory the server creates in a state directory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file the server creates in a state directory.
pub const FILE_MODE: u32 = 0o600;

/// Why a state directory (or one of its directories) is not used.
#[derive(Debug, Error)]
pub enum PermissionError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} is owned by uid {owner}, not by uid {uid} that this server runs as; \
         another user's directory is not used for sessions (chown it, or choose another)"
    )]
    ForeignOwner { path: PathBuf, owner: u32, uid: u32 },
    #[error(
        "{path} has mode {mode:04o}: group or others may write it, so its files cannot be \
         trusted; it must not be writable by group or others (chmod go-w, or 0700)"
    )]
    Writable { path: PathBuf, mode: u32 },
}

/// Options that create a file `0600` and refuse to follow a symbolic link
/// at its path (the open fails with `ELOOP`).
pub fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.mode(FILE_MODE).custom_flags(libc::O_NOFOLLOW);
    options
}

/// The state directory itself: created `0700` when missing (its parents
/// with the umask's modes), refused when another user owns it or group or
/// others may write it. An existing directory's read bits are left as its
/// owner set them: what is inside is private either way.
pub fn state_dir(dir: &Path) -> Result<(), PermissionError> {
    if !dir.exists() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        create(dir)?;
    }
    check(dir).map(|_| ())
}

/// A directory the server keeps inside the state directory (`sessions/`,
/// `spill/`): created `0700` when missing, refused as [`state_dir`] says,
/// and made `0700` when it is readable by others (a directory an earlier
/// version created under a looser umask: its listing names the sessions).
pub fn inner_dir(dir: &Path) -> Result<(), PermissionError> {
    if !dir.exists() {
        create(dir)?;
    }
    let mode = check(dir)?;
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE))
            .map_err(io(dir))?;
        tracing::warn!(path = %dir.display(), "made the directory private (0700): its mode was {mode:04o}");
    }
    Ok(())
}

fn create(dir: &Path) -> Result<(), PermissionError> {
    match DirBuilder::new().mode(DIR_MODE).create(dir) {
        Ok(()) => Ok(()),
        // Made meanwhile by someone else: checked below like any other.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io(dir)(e)),
    }
}

/// Checks owner and write bits; returns the permission bits.
fn check(dir: &Path) -> Result<u32, PermissionError> {
    let meta = std::fs::metadata(dir).map_err(io(dir))?;
    if !meta.is_dir() {
        return Err(PermissionError::NotADirectory {
            path: dir.to_owned(),
        });
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid {
        return Err(PermissionError::ForeignOwner {
            path: dir.to_owned(),
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(PermissionError::Writable {
            path: dir.to_owned(),
            mode,
        });
    }
    Ok(mode)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PermissionError + '_ {
    move |source| PermissionError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn directories_and_files_are_private_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: umask has no preconditions; 022 is the usual default, so
        // other tests running meanwhile see nothing unusual.
        unsafe { libc::umask(0o022) };
        let state = dir.path().join("a/b/state");
        state_dir(&state).unwrap();
        assert_eq!(mode_of(&state), DIR_MODE);
        inner_dir(&state.join("sessions")).unwrap();
        assert_eq!(mode_of(&state.join("sessions")), DIR_MODE);
        let file = state.join("f");
        options().create(true).write(true).open(&file).unwrap();
        assert_eq!(mode_of(&file), FILE_MODE);
    }

    #[test]
    fn a_writable_or_loose_directory_is_refused_or_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o775)).unwrap();
        let err = state_dir(&state).unwrap_err();
        assert!(matches!(err, PermissionError::Writable { mode: 0o775, .. }));
        assert!(err.to_string().contains("0775"), "{err}");
        // Readable by others is the owner's choice for the directory
        // itself; the ones inside are made private.
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
        state_dir(&state).unwrap();
        assert_eq!(mode_of(&state), 0o755);
        let inner = state.join("sessions");
        std::fs::create_dir(&inner).unwrap();
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o755)).unwrap();
        inner_dir(&inner).unwrap();
        assert_eq!(mode_of(&inner), DIR_MODE);
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o722)).unwrap();
        assert!(matches!(
            inner_dir(&inner),
            Err(PermissionError::Writable { .. })
        ));
        let file = state.join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            state_dir(&file),
            Err(PermissionError::NotADirectory { .. })
        ));
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: changing a directory's owner needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::os::unix::fs::chown(&state, Some(65534), Some(65534)).unwrap();
        let err = state_dir(&state).unwrap_err();
        assert!(
            matches!(err, PermissionError::ForeignOwner { owner: 65534, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_link_where_a_file_should_be_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let opened = options()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&link);
        assert_eq!(opened.unwrap_err().raw_os_error(), Some(libc::ELOOP));
        let opened = options().append(true).open(&link);
        assert!(opened.is_err());
        let mut plain = options().create(true).write(true).open(&target).unwrap();
        plain.write_all(b"!").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"!eep");
    }
}
