//! CONTRACT §2.2 through the wire: the same history, however it was
//! built, generates the same bits.

use super::*;

// ---------------------------------------------------------------- §2.2 --

/// How a session's history is built.
#[derive(Clone, Copy, Debug)]
enum Build {
    OneAppend,
    TokenByToken,
    RandomChunks(u64),
    /// `prefix` appended, the rest generated greedily (the history must be
    /// that greedy continuation).
    PartlyGenerated {
        prefix: usize,
    },
}

/// What must be identical however the history was built: the digest, a
/// greedy continuation, the digest after it, a seeded continuation, the
/// digest after that.
#[derive(Debug, PartialEq, Eq)]
struct Fingerprint {
    digest: u64,
    greedy: Vec<u32>,
    digest_after_greedy: u64,
    seeded: Vec<u32>,
    digest_after_seeded: u64,
}

fn build_history(served: &Served, id: &str, history: &[u32], build: Build) {
    match build {
        Build::OneAppend => {
            served.append(id, history).expect("append");
        }
        Build::TokenByToken => {
            for &t in history {
                served.append(id, &[t]).expect("append");
            }
        }
        Build::RandomChunks(seed) => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut at = 0;
            while at < history.len() {
                let n = rng.gen_range(1..=13).min(history.len() - at);
                served.append(id, &history[at..at + n]).expect("append");
                at += n;
            }
        }
        Build::PartlyGenerated { prefix } => {
            served.append(id, &history[..prefix]).expect("append");
            let want = (history.len() - prefix) as u32;
            let (generated, _) = served.run(gen_req(id, want));
            assert_eq!(generated, history[prefix..], "greedy continuation");
        }
    }
    assert_eq!(served.history(id), history.len() as u64, "{build:?}");
}

fn fingerprint(served: &Served, id: &str) -> Fingerprint {
    let digest = served.digest(id);
    let greedy = served.run(gen_req(id, 12)).0;
    let digest_after_greedy = served.digest(id);
    let seeded = served.run(seeded_req(id, 12, Some(1234))).0;
    Fingerprint {
        digest,
        greedy,
        digest_after_greedy,
        seeded,
        digest_after_seeded: served.digest(id),
    }
}

/// A 40-token prompt followed by its 30-token greedy continuation.
fn partly_generated_history(served: &Served) -> Vec<u32> {
    let mut history = prompt(40, 3);
    let id = served.create("history", &[]);
    served.append(&id, &history).expect("append");
    history.extend(served.run(gen_req(&id, 30)).0);
    history
}

#[test]
fn the_same_history_built_any_way_generates_the_same_bits() {
    let served = Served::tiny(1);
    let history = partly_generated_history(&served);
    let reference_id = served.create("reference", &[]);
    build_history(&served, &reference_id, &history, Build::OneAppend);
    let reference = fingerprint(&served, &reference_id);
    assert_ne!(reference.digest, 0);
    assert_ne!(reference.digest, reference.digest_after_greedy);
    assert!(
        reference.seeded.iter().any(|&t| t != reference.seeded[0]),
        "seeded sampling varies: {:?}",
        reference.seeded
    );
    for build in [
        Build::TokenByToken,
        Build::RandomChunks(1),
        Build::RandomChunks(2),
        Build::PartlyGenerated { prefix: 40 },
        Build::PartlyGenerated { prefix: 55 },
    ] {
        let id = served.create("build", &[]);
        build_history(&served, &id, &history, build);
        assert_eq!(fingerprint(&served, &id), reference, "{build:?}");
    }
    // A different history gives a different fingerprint (the check can fail).
    let other = served.create("other", &[]);
    let mut changed = history.clone();
    changed[10] = (changed[10] + 1) % TINY_VOCAB;
    build_history(&served, &other, &changed, Build::OneAppend);
    assert_ne!(fingerprint(&served, &other).digest, reference.digest);
    served.stop();
}

#[test]
fn determinism_holds_across_workers_and_with_neighbours_generating() {
    let single = Served::tiny(1);
    let history = partly_generated_history(&single);
    let id = single.create("reference", &[]);
    build_history(&single, &id, &history, Build::OneAppend);
    let reference = fingerprint(&single, &id);
    single.stop();

    let served = Served::tiny(3);
    let mut seen_workers = std::collections::HashSet::new();
    let builds = [
        Build::OneAppend,
        Build::TokenByToken,
        Build::RandomChunks(3),
        Build::PartlyGenerated { prefix: 40 },
        Build::OneAppend,
        Build::RandomChunks(4),
    ];
    for (k, build) in builds.into_iter().enumerate() {
        // Neighbours on every worker, generating while this session is
        // built and generates.
        let neighbours: Vec<Gen> = (0..3)
            .map(|j| {
                let n = served.create("neighbour", &[]);
                served
                    .append(&n, &prompt(20 + 7 * j, (k * 3 + j) as u32))
                    .expect("append");
                served.generate(seeded_req(&n, 200, Some(j as u64)))
            })
            .collect();
        let created = served.try_create("build", &[]).expect("created");
        seen_workers.insert(created.get_worker());
        let id = created.get_session_id();
        build_history(&served, id, &history, build);
        assert_eq!(
            fingerprint(&served, id),
            reference,
            "{build:?} on worker {}",
            created.get_worker()
        );
        for n in neighbours {
            let outcome = n.finish(STREAM_TIMEOUT);
            assert_eq!(outcome.tokens().len(), 200);
            outcome.done();
        }
    }
    assert!(
        seen_workers.len() >= 2,
        "sessions landed on different workers: {seen_workers:?}"
    );
    served.stop();
}

#[test]
fn reference_model_history_built_any_way_generates_the_same_tokens() {
    let Some(path) = reference_model_path() else {
        return;
    };
    let model = Arc::new(Model::load(&path).expect("reference model loads"));
    let served = Served::start(model, loopback(runtime_config(2)));
    // "The quick brown fox" style ids; any ids below the vocabulary will do.
    let history: Vec<u32> = vec![1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 3290, 30];
    let mut results = Vec::new();
    for build in [
        Build::OneAppend,
        Build::TokenByToken,
        Build::RandomChunks(5),
    ] {
        let id = served.create("real", &[]);
        build_history(&served, &id, &history, build);
        let digest = served.digest(&id);
        let (tokens, done) = served.run(gen_req(&id, 6));
        assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
        results.push((digest, tokens, served.digest(&id)));
    }
    assert_eq!(results[0].1.len(), 6);
    assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
    served.stop();
}
