//! How fast this CPU's AMX tile instructions are, for sizing the prefill
//! kernels' tiles: nanoseconds per `tdpbusd` at the depths the kernels can
//! use, with operands in tiles and loaded from L1, and per `tilestored`.
//! Prints why where the CPU or kernel has no AMX.
//!
//! `cargo bench --bench amx_tiles`

fn main() {
    #[cfg(target_arch = "x86_64")]
    match inferd::quant::amx::probe() {
        Ok(rows) => {
            for (what, ns) in rows {
                println!("{what:<40} {ns:>8.2} ns");
            }
        }
        Err(why) => println!("AMX unavailable: {why:?}"),
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("AMX is an x86-64 feature");
}
