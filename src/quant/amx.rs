//! Intel AMX tiles: detection, the kernel's permission to use them, the
//! tile configuration, and the few tile instructions the prefill kernels
//! use, as inline assembly (the AMX intrinsics are not stable Rust).
//!
//! A tile instruction works on the eight 1 KiB tile registers `tmm0..7`,
//! shaped by the configuration loaded last on this thread (`ldtilecfg`).
//! The compiler never touches those registers, so a configuration and the
//! tiles' contents persist between `asm!` blocks of one thread; every
//! kernel still loads what it reads and stores what it wants within the
//! blocks of one call, and loads its configuration at the start of each
//! call (a thread may run kernels of different shapes in turn).
//!
//! Linux hands out the 8 KiB of tile state only to a process that asked
//! for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without
//! that the first tile instruction is a fault. [`available`] asks once per
//! process and says whether the CPU, the kernel and the permission allow
//! AMX-INT8.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::asm;
use std::arch::x86_64::__cpuid_count;
use std::sync::OnceLock;

/// `arch_prctl` request for permission to use an extended state feature.
const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
/// The XSAVE feature number of the tile data (XTILEDATA).
const XFEATURE_XTILEDATA: libc::c_ulong = 18;

/// Why AMX is not used on this machine (for the log line that names the
/// SIMD level).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// CPUID reports no AMX-TILE or no AMX-INT8.
    NoCpuSupport,
    /// The kernel refused the tile data permission (too old a kernel, or
    /// a hypervisor that hides the state).
    PermissionRefused,
}

/// Whether this process may run AMX-INT8 tile instructions; asks the kernel
/// for the permission the first time it is called.
pub fn available() -> Result<(), Unavailable> {
    static STATE: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    *STATE.get_or_init(|| {
        if !cpu_has_amx_int8() {
            return Err(Unavailable::NoCpuSupport);
        }
        // SAFETY: arch_prctl with an integer request and argument reads
        // and writes no memory of ours.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(Unavailable::PermissionRefused)
        }
    })
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (EDX bit 25).
fn cpu_has_amx_int8() -> bool {
    // Leaf 0 says how many leaves there are.
    let max_leaf = __cpuid_count(0, 0).eax;
    if max_leaf < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// The 64-byte operand of `ldtilecfg` (palette 1): each tile's rows and
/// bytes per row.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// A configuration with every tile unused.
    pub const fn new() -> Self {
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }

    /// Tile `tmm` gets `rows` rows of `bytes` bytes (at most 16 and 64).
    pub const fn tile(mut self, tmm: usize, rows: u8, bytes: u16) -> Self {
        assert!(tmm < 8 && rows <= 16 && bytes <= 64);
        self.rows[tmm] = rows;
        self.colsb[tmm] = bytes;
        self
    }

    /// Loads this configuration on the calling thread (zeroing every tile).
    ///
    /// # Safety
    /// [`available`] must have returned `Ok`.
    #[inline]
    pub unsafe fn load(&self) {
        // SAFETY: 64 readable bytes; the caller promises AMX.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self as *const Self, options(nostack, readonly)) };
    }
}

/// Frees this thread's tile state (so that a context switch need not save
/// it).
///
/// # Safety
/// [`available`] must have returned `Ok`.
#[inline]
pub unsafe fn release() {
    // SAFETY: the caller promises AMX.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Timings of the tile instructions on this CPU, for choosing the kernels'
/// shapes: nanoseconds per `tdpbusd` with A tiles of 16 rows of `k` bytes
/// (B of `k / 4` rows of 64 bytes) for `k` = 64, 32 and 4, with the
/// operands in registers; the same for 64 and 32 with the operands loaded
/// from L1 for every product; and per `tilestored` of a 16x64-byte tile.
pub fn probe() -> Result<Vec<(String, f64)>, Unavailable> {
    available()?;
    let mut out = Vec::new();
    let iters = 200_000u64;
    for k in [64u16, 32, 4] {
        // SAFETY: AMX is available (checked above).
        let ns = unsafe { time_products_in_registers(k, iters) };
        out.push((format!("tdpbusd 16x16x{k}, operands in tiles"), ns));
    }
    for k in [64u16, 32] {
        // SAFETY: as above.
        let ns = unsafe { time_products_loading(k, iters / 4) };
        out.push((format!("tileloadd A+B then tdpbusd 16x16x{k}"), ns));
    }
    // SAFETY: as above.
    let ns = unsafe { time_stores(iters / 4) };
    out.push(("tilestored 16x64".to_string(), ns));
    Ok(out)
}

/// The configuration of the probes: C tiles 0..4 (16 x 64 bytes), A tiles
/// 4 and 5 (16 x `k`), B tiles 6 and 7 (`k / 4` x 64).
fn probe_config(k: u16) -> TileConfig {
    let b_rows = (k / 4) as u8;
    TileConfig::new()
        .tile(0, 16, 64)
        .tile(1, 16, 64)
        .tile(2, 16, 64)
        .tile(3, 16, 64)
        .tile(4, 16, k)
        .tile(5, 16, k)
        .tile(6, b_rows, 64)
        .tile(7, b_rows, 64)
}

/// # Safety
/// [`available`] must have returned `Ok`.
unsafe fn time_products_in_registers(k: u16, iters: u64) -> f64 {
    let cfg = probe_config(k);
    let data = vec![1u8; 1024];
    // SAFETY: the caller promises AMX; every tile load reads at most 16
    // rows of 64 bytes from `data` (1 KiB, stride 64).
    unsafe {
        cfg.load();
        asm!(
            "tileloadd tmm4, [{p} + {s}*1]",
            "tileloadd tmm5, [{p} + {s}*1]",
            "tileloadd tmm6, [{p} + {s}*1]",
            "tileloadd tmm7, [{p} + {s}*1]",
            p = in(reg) data.as_ptr(),
            s = in(reg) 64usize,
            options(nostack, readonly),
        );
        let t0 = std::time::Instant::now();
        asm!(
            "2:",
            "tdpbusd tmm0, tmm4, tmm6",
            "tdpbusd tmm1, tmm4, tmm7",
            "tdpbusd tmm2, tmm5, tmm6",
            "tdpbusd tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iters => _,
            options(nostack, nomem),
        );
        let ns = t0.elapsed().as_nanos() as f64 / (4 * iters) as f64;
        release();
        ns
    }
}

/// # Safety
/// [`available`] must have returned `Ok`.
unsafe fn time_products_loading(k: u16, iters: u64) -> f64 {
    let cfg = probe_config(k);
    let data = vec![1u8; 4096];
    // SAFETY: the caller promises AMX; the loads read 16 rows of 64 bytes
    // at offsets up to 3 KiB of `data` (4 KiB).
    unsafe {
        cfg.load();
        let t0 = std::time::Instant::now();
        asm!(
            "2:",
            "tileloadd tmm4, [{a} + {s}*1]",
            "tileloadd tmm6, [{b} + {s}*1]",
            "tdpbusd tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{c} + {s}*1]",
            "tdpbusd tmm2, tmm5, tmm6",
            "tileloadd tmm7, [{d} + {s}*1]",
            "tdpbusd tmm1, tmm4, tmm7",
            "tdpbusd tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            a = in(reg) data.as_ptr(),
            b = in(reg) data.as_ptr().add(1024),
            c = in(reg) data.as_ptr().add(2048),
            d = in(reg) data.as_ptr().add(3072),
            s = in(reg) 64usize,
            n = inout(reg) iters => _,
            options(nostack, readonly),
        );
        let ns = t0.elapsed().as_nanos() as f64 / (4 * iters) as f64;
        release();
        ns
    }
}

/// # Safety
/// [`available`] must have returned `Ok`.
unsafe fn time_stores(iters: u64) -> f64 {
    let cfg = probe_config(64);
    let mut data = vec![0u8; 4096];
    // SAFETY: the caller promises AMX; each store writes 16 rows of 64
    // bytes at offsets up to 3 KiB of `data` (4 KiB).
    unsafe {
        cfg.load();
        let t0 = std::time::Instant::now();
        asm!(
            "2:",
            "tilestored [{a} + {s}*1], tmm0",
            "tilestored [{b} + {s}*1], tmm1",
            "tilestored [{c} + {s}*1], tmm2",
            "tilestored [{d} + {s}*1], tmm3",
            "dec {n}",
            "jnz 2b",
            a = in(reg) data.as_mut_ptr(),
            b = in(reg) data.as_mut_ptr().add(1024),
            c = in(reg) data.as_mut_ptr().add(2048),
            d = in(reg) data.as_mut_ptr().add(3072),
            s = in(reg) 64usize,
            n = inout(reg) iters => _,
            options(nostack),
        );
        let ns = t0.elapsed().as_nanos() as f64 / (4 * iters) as f64;
        release();
        ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `c[m][n] += Σ_k a[m][k] · b[k / 4][4n + k % 4]` for `m, n < 16`,
    /// `k < bytes` (`a` unsigned, `b` signed): one `tdpbusd` on tiles loaded
    /// from `a` (16 rows of `bytes`, stride `bytes`) and `b` (`bytes / 4` rows
    /// of 64), `c` loaded, accumulated and stored back.
    ///
    /// # Safety
    /// [`available`] must have returned `Ok`; `bytes` a multiple of 4 up to 64.
    unsafe fn dpbusd_16x16(a: &[u8], b: &[i8], c: &mut [i32; 256], bytes: u16) {
        assert!(bytes.is_multiple_of(4) && (4..=64).contains(&bytes));
        assert!(a.len() >= 16 * bytes as usize && b.len() >= 16 * bytes as usize);
        let cfg =
            TileConfig::new()
                .tile(0, 16, 64)
                .tile(1, 16, bytes)
                .tile(2, (bytes / 4) as u8, 64);
        // SAFETY: the caller promises AMX; the loads and the store stay within
        // `a`, `b` and `c` (checked above).
        unsafe {
            cfg.load();
            asm!(
                "tileloadd tmm0, [{c} + {s64}*1]",
                "tileloadd tmm1, [{a} + {sa}*1]",
                "tileloadd tmm2, [{b} + {s64}*1]",
                "tdpbusd tmm0, tmm1, tmm2",
                "tilestored [{c} + {s64}*1], tmm0",
                a = in(reg) a.as_ptr(),
                b = in(reg) b.as_ptr(),
                c = in(reg) c.as_mut_ptr(),
                sa = in(reg) bytes as usize,
                s64 = in(reg) 64usize,
                options(nostack),
            );
            release();
        }
    }

    fn lcg(seed: &mut u64) -> u8 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u8
    }

    /// One `tdpbusd` against the sum it stands for, at every depth the
    /// kernels use; skipped, loudly, where the CPU or kernel has no AMX.
    #[test]
    fn tdpbusd_matches_the_scalar_sum() {
        if let Err(why) = available() {
            eprintln!("AMX TESTS SKIPPED: {why:?}");
            if std::env::var_os("INFERD_REQUIRE_AMX").is_some() {
                panic!("INFERD_REQUIRE_AMX is set but AMX is unavailable: {why:?}");
            }
            return;
        }
        let mut seed = 7;
        for bytes in [4u16, 32, 64] {
            let k = bytes as usize;
            let a: Vec<u8> = (0..16 * k).map(|_| lcg(&mut seed)).collect();
            let b: Vec<i8> = (0..16 * k).map(|_| lcg(&mut seed) as i8).collect();
            let mut c = [0i32; 256];
            for (i, v) in c.iter_mut().enumerate() {
                *v = i as i32 * 1000 - 100_000;
            }
            let mut expected = c;
            for m in 0..16 {
                for n in 0..16 {
                    for kk in 0..k {
                        expected[m * 16 + n] +=
                            a[m * k + kk] as i32 * b[(kk / 4) * 64 + 4 * n + kk % 4] as i32;
                    }
                }
            }
            // SAFETY: AMX is available; the sizes are as asked.
            unsafe { dpbusd_16x16(&a, &b, &mut c, bytes) };
            assert_eq!(c, expected, "depth {bytes}");
        }
    }
}
