//! CONTRACT §2.12 through the wire: sessions whose histories start with
//! the same full pages of tokens hold those pages once, mapped instead of
//! computed, and continue with exactly the bits of a cold prefill (checked
//! against a server that never saw the prefix). Pages go back to the pool
//! when the last session holding them closes, or stay in the prefix cache
//! up to its budget and give way when the pool is short.

use super::*;

use inferd::runtime::RuntimeStats;

/// The tiny model's layers: one pool page each per page of positions.
const LAYERS: u64 = 2;
const PAGE: usize = 16;

/// The continuation of `history` on a fresh server: nothing to map.
fn cold(history: &[u32]) -> Continuation {
    let served = Served::tiny(1);
    let id = served.create("cold", &[]);
    served.append(&id, history).expect("append");
    let got = continuation(&served, &id);
    assert_eq!(served.server().runtime_stats().prefix_reused_tokens, 0);
    served.stop();
    got
}

fn stats(served: &Served) -> RuntimeStats {
    served.server().runtime_stats()
}

fn used_pages(stats: &RuntimeStats) -> u64 {
    stats.kv_total_pages - stats.kv_free_pages
}

#[test]
fn a_common_prefix_is_mapped_across_workers_and_continues_with_the_bits_of_a_cold_prefill() {
    let history = prompt(100, 3); // 6 full pages and 4 positions
    let mut branch = history[..50].to_vec(); // 3 full pages in common
    branch.extend(prompt(30, 8));
    let (cold_history, cold_branch) = (cold(&history), cold(&branch));

    let served = Served::tiny(2);
    let first = served.try_create("first", &[]).expect("create");
    served
        .append(first.get_session_id(), &history)
        .expect("append");
    assert_eq!(stats(&served).prefix_reused_tokens, 0);
    assert_eq!(continuation(&served, first.get_session_id()), cold_history);

    // The next session lands on the other worker and maps all six pages
    // (one token at least is computed: its logits are the result).
    let second = served.try_create("second", &[]).expect("create");
    assert_ne!(second.get_worker(), first.get_worker());
    assert_eq!(
        served
            .append(second.get_session_id(), &history)
            .expect("append"),
        history.len() as u64
    );
    assert_eq!(stats(&served).prefix_reused_tokens, 96);
    assert_eq!(continuation(&served, second.get_session_id()), cold_history);

    // A history that parts from it in the fourth page maps three.
    let third = served.create("third", &[]);
    served.append(&third, &branch).expect("append");
    assert_eq!(stats(&served).prefix_reused_tokens, 96 + 48);
    assert_eq!(continuation(&served, &third), cold_branch);

    // Appended in pieces, the prefix is found again by each piece that
    // starts on a page boundary (one page of the first is computed, so
    // that its logits are had; the second maps four more).
    let pieces = served.create("pieces", &[]);
    served.append(&pieces, &history[..32]).expect("append");
    served.append(&pieces, &history[32..]).expect("append");
    assert_eq!(stats(&served).prefix_reused_tokens, 96 + 48 + 16 + 64);
    assert_eq!(continuation(&served, &pieces), cold_history);
    served.stop();
}

#[test]
fn sessions_sharing_a_prefix_hold_it_once_and_give_every_page_back_when_closed() {
    let served = Served::tiny(2);
    let total = stats(&served).kv_total_pages;
    let system = prompt(96, 4); // 6 full pages
    let mut ids = Vec::new();
    for k in 0..8 {
        let id = served.create("agent", &[]);
        let mut history = system.clone();
        history.extend(prompt(20, 100 + k));
        served.append(&id, &history).expect("append");
        ids.push(id);
    }
    // 116 positions are 8 pages a layer: the first session computed all of
    // them, the others mapped the 6 shared ones and hold 2 of their own.
    let now = stats(&served);
    assert_eq!(used_pages(&now), (8 + 7 * 2) * LAYERS, "{now:?}");
    assert_eq!(now.prefix_reused_tokens, 7 * 96);
    let page_bytes = served.info(&ids[0]).expect("info").get_kv_page_bytes();
    assert_eq!(now.kv_used_bytes, used_pages(&now) * page_bytes);
    // Each session still reports everything it holds.
    for id in &ids {
        let info = served.info(id).expect("info");
        assert_eq!(info.get_kv_pages_held(), 8 * LAYERS);
        assert_eq!(info.get_history_length(), 116);
    }
    // Closing the first computer of the prefix disturbs nobody.
    served.close(&ids[0]).expect("close");
    let mut history = system.clone();
    history.extend(prompt(20, 101));
    let expected = cold(&history);
    assert_eq!(continuation(&served, &ids[1]), expected);
    for id in &ids[1..] {
        served.close(id).expect("close");
    }
    let t0 = Instant::now();
    loop {
        let now = stats(&served);
        if now.kv_free_pages == total && now.prefix_entries == 0 && now.kv_live_bytes == 0 {
            break;
        }
        assert!(t0.elapsed() < CALL_TIMEOUT, "pages still held: {now:?}");
        thread::sleep(Duration::from_millis(10));
    }
    served.stop();
}

#[test]
fn the_prefix_cache_keeps_released_pages_for_the_next_session_and_yields_them_when_short() {
    // 16 pages of positions (the whole context) over the two layers; the
    // cache may keep all of them.
    let page_bytes = 16 * 32 * 2 * 2; // positions x kv_dim x (K, V) x f16
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            kv_bytes: 32 * page_bytes,
            prefix_cache_pages: usize::MAX,
            eviction: inferd::runtime::EvictionPolicy::None,
            ..runtime_config(1)
        }),
    );
    let total = stats(&served).kv_total_pages;
    assert_eq!(total, 32);
    let history = prompt(100, 6);
    let expected = cold(&history);
    let first = served.create("first", &[]);
    served.append(&first, &history).expect("append");
    served.close(&first).expect("close");
    let cached = stats(&served);
    assert_eq!(cached.prefix_cached_pages, 6 * LAYERS, "{cached:?}");
    assert_eq!(cached.kv_free_pages, total - 6 * LAYERS);

    // A later session with the same history maps the cached pages.
    let second = served.create("second", &[]);
    served.append(&second, &history).expect("append");
    assert_eq!(stats(&served).prefix_reused_tokens, 96);
    assert_eq!(continuation(&served, &second), expected);
    served.close(&second).expect("close");

    // Another history that needs the whole pool gets it: the cache gives
    // its pages back (no session is evicted: eviction is off).
    let other = served.create("other", &[]);
    let fill = (total / LAYERS) as usize * PAGE;
    served
        .append(&other, &prompt(fill, 9))
        .expect("the whole pool");
    let now = stats(&served);
    assert_eq!(now.kv_free_pages, 0, "{now:?}");
    assert_eq!(now.prefix_cached_pages, 0, "{now:?}");
    assert_eq!(now.evicted_lru, 0);
    served.stop();
}
