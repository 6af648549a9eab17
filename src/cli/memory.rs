//! How much memory this machine (or this process's cgroup) can give, so a
//! KV cache that can never fit is refused at start-up with the numbers
//! instead of failing, or being killed, once sessions fill it.

use super::CliError;

/// What the machine can hold, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Physical memory, or the cgroup's limit when lower.
    pub total: u64,
    /// What can be allocated now without swapping (Linux `MemAvailable`,
    /// capped by what the cgroup has left); `None` where unknown.
    pub available: Option<u64>,
}

/// The limits of this machine, or `None` where they cannot be read.
pub fn limits() -> Option<MemoryLimits> {
    #[cfg(target_os = "linux")]
    {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let mut limits = from_meminfo(&meminfo)?;
        if let Some((max, current)) = cgroup_v2() {
            limits.total = limits.total.min(max);
            let left = max.saturating_sub(current);
            limits.available = Some(limits.available.map_or(left, |a| a.min(left)));
        }
        Some(limits)
    }
    #[cfg(target_os = "macos")]
    {
        let mut bytes: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: the name is a NUL-terminated C string and `bytes`/`len`
        // describe a writable u64, as sysctlbyname requires for hw.memsize.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&mut bytes as *mut u64).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0).then_some(MemoryLimits {
            total: bytes,
            available: None,
        })
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        None
    }
}

/// `MemTotal` and `MemAvailable` from the text of /proc/meminfo.
fn from_meminfo(text: &str) -> Option<MemoryLimits> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    };
    Some(MemoryLimits {
        total: field("MemTotal")?,
        available: field("MemAvailable"),
    })
}

/// The cgroup v2 memory limit and current use of this process, when limited.
#[cfg(target_os = "linux")]
fn cgroup_v2() -> Option<(u64, u64)> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = membership.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let max = read("memory.max")?.trim().parse::<u64>().ok()?;
    let current = read("memory.current")?.trim().parse::<u64>().ok()?;
    Some((max, current))
}

const MIB: u64 = 1 << 20;

/// Refuses a KV cache of `kv_bytes` of anonymous memory next to `weights`
/// bytes of mapped model when the machine cannot hold it: more than it has
/// available now, or, with the weights, more than it has at all.
pub fn check_kv_fits(
    kv_bytes: u64,
    weights: u64,
    limits: Option<MemoryLimits>,
) -> Result<(), CliError> {
    let Some(limits) = limits else {
        return Ok(());
    };
    let needed = kv_bytes.saturating_add(weights);
    if needed > limits.total {
        return Err(CliError::Usage(format!(
            "a KV cache of {} MiB and {} MiB of model weights need {} MiB, more than the \
             {} MiB of memory here: lower --kv-mib",
            kv_bytes / MIB,
            weights / MIB,
            needed / MIB,
            limits.total / MIB
        )));
    }
    if let Some(available) = limits.available.filter(|&a| kv_bytes > a) {
        return Err(CliError::Usage(format!(
            "a KV cache of {} MiB is more than the {} MiB of memory available now: \
             lower --kv-mib",
            kv_bytes / MIB,
            available / MIB
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            from_meminfo(text),
            Some(MemoryLimits {
                total: 24_000_000 * 1024,
                available: Some(20_000_000 * 1024),
            })
        );
        assert_eq!(from_meminfo("nothing"), None);
    }

    #[test]
    fn a_kv_cache_the_machine_cannot_hold_is_refused_with_its_numbers() {
        let limits = Some(MemoryLimits {
            total: 16 << 30,
            available: Some(8 << 30),
        });
        check_kv_fits(4 << 30, 4 << 30, limits).expect("fits");
        let err = check_kv_fits(14 << 30, 4 << 30, limits).expect_err("over the total");
        assert!(err.to_string().contains("18432 MiB"), "{err}");
        assert!(err.to_string().contains("16384 MiB"), "{err}");
        let err = check_kv_fits(10 << 30, 1 << 30, limits).expect_err("over what is available");
        assert!(err.to_string().contains("8192 MiB"), "{err}");
        check_kv_fits(u64::MAX, 0, None).expect("unknown limits refuse nothing");
    }
}
