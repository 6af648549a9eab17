//! The replicas' session store against a real PostgreSQL (a server of the
//! test's own, `support::postgres`): the schema made once and a newer one
//! refused; leases that fence every write, so a replica whose session was
//! taken over can write nothing more; one winner when replicas race for a
//! session; and a store that goes away failing calls typed, then serving
//! again, with nothing acknowledged lost.

mod support;

use std::time::{Duration, Instant};

use inferd::replica::{Lease, NewSession, Store, StoreError, SCHEMA_VERSION};
use support::postgres::Postgres;

const SHORT: Duration = Duration::from_millis(600);

fn store(pg: &Postgres, replica: &str, lease: Duration) -> Store {
    Store::connect(&pg.url, replica, lease).expect("connects")
}

/// A session of no tenant as it is first written.
fn session<'a>(label: &'a str, eos: &'a [u32], history: &'a [u32]) -> NewSession<'a> {
    NewSession {
        label,
        eos,
        tenant: None,
        history,
        source: None,
    }
}

/// Waits out a lease of [`SHORT`].
fn after_lease() {
    std::thread::sleep(SHORT + Duration::from_millis(300));
}

#[test]
fn the_schema_is_made_once_and_a_newer_one_is_refused() {
    let Some(pg) = Postgres::start() else { return };
    store(&pg, "a", SHORT);
    store(&pg, "b", SHORT);
    let mut client = pg.client();
    let versions: Vec<i32> = client
        .query("SELECT version FROM inferd_schema ORDER BY version", &[])
        .expect("reads")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, (1..=SCHEMA_VERSION).collect::<Vec<_>>());
    client
        .execute(
            "INSERT INTO inferd_schema (version) VALUES ($1)",
            &[&(SCHEMA_VERSION + 1)],
        )
        .expect("writes");
    match Store::connect(&pg.url, "c", SHORT) {
        Err(StoreError::SchemaTooNew { found, known }) => {
            assert_eq!((found, known), (SCHEMA_VERSION + 1, SCHEMA_VERSION))
        }
        other => panic!("a newer schema was taken: {other:?}"),
    }
}

#[test]
fn a_replica_whose_session_was_taken_over_writes_nothing_more() {
    let Some(pg) = Postgres::start() else { return };
    let mut a = store(&pg, "a", SHORT);
    let mut b = store(&pg, "b", SHORT);
    let lease_a = a
        .create("s1", &session("chat", &[2], &[1, 5, 9]))
        .expect("created");
    a.append("s1", lease_a, &[10, 11]).expect("appended");
    // A live lease is not taken.
    match b.take("s1", None) {
        Err(StoreError::HeldElsewhere { owner, left, .. }) => {
            assert_eq!(owner, "a");
            assert!(left <= SHORT, "{left:?}");
        }
        other => panic!("a held session was taken: {other:?}"),
    }
    // Once it runs out (the owner paused, cut off or dead), it is.
    after_lease();
    let (lease_b, row) = b.take("s1", None).expect("taken over");
    assert!(lease_b.epoch > lease_a.epoch);
    assert_eq!(row.history, [1, 5, 9, 10, 11]);
    assert_eq!(
        (row.label.as_str(), row.eos.as_slice(), row.changes),
        ("chat", &[2][..], 2)
    );
    // The old owner comes back: every write it tries is refused, and
    // changes nothing; a fork of its stale copy is not written either.
    let stale_fork = NewSession {
        source: Some(("s1", lease_a)),
        ..session("chat", &[2], &[1, 5, 9])
    };
    match a.create("s1-fork", &stale_fork) {
        Err(StoreError::Fenced { id, epoch }) => {
            assert_eq!((id.as_str(), epoch), ("s1", lease_a.epoch))
        }
        other => panic!("a fork of a lost session was written: {other:?}"),
    }
    assert!(a.load("s1-fork").expect("reads").is_none());
    // The holder's fork is.
    let fork = NewSession {
        source: Some(("s1", lease_b)),
        ..session("chat", &[2], &[1, 5])
    };
    b.create("s1-fork", &fork)
        .expect("a fork of a held session");
    assert_eq!(
        b.load("s1-fork")
            .expect("reads")
            .expect("written")
            .0
            .history,
        [1, 5]
    );
    for refused in [
        a.append("s1", lease_a, &[99]),
        a.set_history("s1", lease_a, &[1]),
        a.release("s1", lease_a),
        a.close("s1", lease_a),
    ] {
        assert!(
            matches!(refused, Err(StoreError::Fenced { ref id, epoch }) if id == "s1" && epoch == lease_a.epoch),
            "{refused:?}"
        );
    }
    assert_eq!(
        a.renew(&[("s1".into(), lease_a.epoch)]).expect("renews"),
        ["s1"]
    );
    let (row, owner, epoch) = a.load("s1").expect("reads").expect("there");
    assert_eq!(
        (row.history, owner, epoch),
        (vec![1, 5, 9, 10, 11], "b".into(), lease_b.epoch)
    );
    // The new owner writes, renews and keeps it.
    b.append("s1", lease_b, &[12]).expect("appended");
    assert!(b
        .renew(&[("s1".into(), lease_b.epoch)])
        .expect("renews")
        .is_empty());
    assert!(matches!(
        a.take("s1", None),
        Err(StoreError::HeldElsewhere { .. })
    ));
    // Given up, it is taken at once; closed, it is gone.
    b.release("s1", lease_b).expect("released");
    let (lease_a2, row) = a.take("s1", None).expect("taken back");
    assert_eq!(row.history, [1, 5, 9, 10, 11, 12]);
    assert!(matches!(
        b.append("s1", lease_b, &[1]),
        Err(StoreError::Fenced { .. })
    ));
    a.close("s1", lease_a2).expect("closed");
    assert!(matches!(b.take("s1", None), Err(StoreError::NotFound(_))));
    assert!(a.load("s1").expect("reads").is_none());
}

#[test]
fn ids_are_unique_and_unknown_ones_are_not_found() {
    let Some(pg) = Postgres::start() else { return };
    let mut a = store(&pg, "a", SHORT);
    let mut b = store(&pg, "b", SHORT);
    let lease = a.create("s1", &session("", &[], &[])).expect("created");
    assert!(matches!(
        b.create("s1", &session("", &[], &[7])),
        Err(StoreError::Exists(_))
    ));
    assert!(matches!(b.take("nope", None), Err(StoreError::NotFound(_))));
    assert!(matches!(
        b.append("nope", Lease { epoch: 1 }, &[1]),
        Err(StoreError::Fenced { .. })
    ));
    // The owner itself takes its session again with a new epoch (a
    // restarted replica), fencing its own earlier lease.
    let (again, row) = a.take("s1", None).expect("taken");
    assert!(again.epoch > lease.epoch && row.history.is_empty());
    assert!(matches!(
        a.append("s1", lease, &[1]),
        Err(StoreError::Fenced { .. })
    ));
}

#[test]
fn replicas_racing_for_a_session_leave_one_owner() {
    let Some(pg) = Postgres::start() else { return };
    let mut a = store(&pg, "a", SHORT);
    a.create("s1", &session("", &[], &[1, 2, 3]))
        .expect("created");
    after_lease();
    let url = pg.url.clone();
    let racers: Vec<_> = (0..6)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut s = Store::connect(&url, &format!("r{i}"), Duration::from_secs(30))
                    .expect("connects");
                s.take("s1", None).map(|(lease, _)| (i, lease))
            })
        })
        .collect();
    let results: Vec<_> = racers
        .into_iter()
        .map(|r| r.join().expect("joins"))
        .collect();
    let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for lost in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(matches!(lost, StoreError::HeldElsewhere { .. }), "{lost:?}");
    }
    let (row, owner, epoch) = a.load("s1").expect("reads").expect("there");
    assert_eq!(owner, format!("r{}", winners[0].0));
    assert_eq!(epoch, winners[0].1.epoch);
    assert_eq!(row.history, [1, 2, 3]);
}

#[test]
fn a_store_that_goes_away_fails_calls_typed_and_loses_nothing_acknowledged() {
    let Some(mut pg) = Postgres::start() else {
        return;
    };
    let mut a = store(&pg, "a", Duration::from_secs(60));
    let lease = a.create("s1", &session("", &[], &[1])).expect("created");
    let mut acknowledged = vec![1];
    for t in 2..6 {
        a.append("s1", lease, &[t]).expect("appended");
        acknowledged.push(t);
    }
    pg.stop();
    let started = Instant::now();
    for t in 6..9 {
        let e = a.append("s1", lease, &[t]).expect_err("no store");
        assert!(matches!(e, StoreError::Unavailable(_)), "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(10), "failed fast");
    pg.start_again();
    // The failed connects' pause (the calls in it fail at once) ends.
    std::thread::sleep(inferd::replica::RETRY_CONNECT);
    a.append("s1", lease, &[9])
        .expect("appended after the restart");
    acknowledged.push(9);
    let (row, _, _) = a.load("s1").expect("reads").expect("there");
    assert_eq!(row.history, acknowledged);
}

#[test]
fn another_tenants_session_is_not_found_and_orphans_idle_past_the_ttl_are_swept() {
    let Some(pg) = Postgres::start() else { return };
    let mut a = store(&pg, "a", SHORT);
    let mut b = store(&pg, "b", SHORT);
    let alices = NewSession {
        tenant: Some("alice"),
        ..session("", &[], &[1, 2])
    };
    a.create("s1", &alices).expect("created");
    after_lease();
    // Another tenant's call finds nothing, and moves nothing.
    assert!(matches!(
        b.take("s1", Some("bob")),
        Err(StoreError::NotFound(_))
    ));
    let (_, owner, epoch) = a.load("s1").expect("reads").expect("there");
    assert_eq!((owner.as_str(), epoch), ("a", 1));
    let (lease, row) = b
        .take("s1", Some("alice"))
        .expect("the owner's call takes it");
    assert_eq!(row.tenant.as_deref(), Some("alice"));
    // A held session is never swept; one let go is, once idle long enough.
    assert_eq!(a.sweep_idle(Duration::ZERO).expect("sweeps"), 0);
    b.release("s1", lease).expect("released");
    assert_eq!(a.sweep_idle(Duration::from_secs(3600)).expect("sweeps"), 0);
    assert_eq!(a.sweep_idle(Duration::ZERO).expect("sweeps"), 1);
    assert!(a.load("s1").expect("reads").is_none());
}
