//! Tests of the inbound checks: a frame over the agreed rows or past the
//! model's context is refused as too large, and takes no credit.

use std::time::SystemTime;

use super::*;
use crate::cluster::payload::Encoding;

const EPOCHS: Epochs = Epochs {
    shard: 5,
    coordinator: 6,
};

fn prefill(sealer: &mut OutboundFrames, position: u64, rows: u32, hidden: usize) -> Vec<u8> {
    let mut frame = pb::Frame::new();
    frame.set_prefill(hidden_body(&[Run {
        session: [1; 16],
        position,
        rows,
    }]));
    frame.set_payload(vec![0; rows as usize * hidden * 4]);
    sealer
        .seal(frame, Some(Encoding::F32), 0)
        .expect("serializable")
}

#[test]
fn frames_over_the_rows_or_past_the_context_are_too_large() {
    let hidden = 8;
    let mut inbound =
        Inbound::to_shard(EPOCHS, 1 << 20, hidden, vec![Encoding::F32], 16).with_row_bounds(4, 100);
    let mut sealer = OutboundFrames::new(EPOCHS);
    let now = SystemTime::now();
    let ok = prefill(&mut sealer, 0, 4, hidden);
    assert_eq!(inbound.check(&ok, now).map(|c| c.rows), Ok(4));
    let many = prefill(&mut sealer, 4, 5, hidden);
    let refused = inbound.check(&many, now).expect_err("5 rows > 4");
    assert_eq!(refused.kind, ErrorKind::TooLarge);
    assert_eq!(refused.sessions, vec![[1; 16]]);
    let past = prefill(&mut sealer, 98, 3, hidden);
    let refused = inbound.check(&past, now).expect_err("98..101 > 100");
    assert_eq!(refused.kind, ErrorKind::TooLarge);
    let last = prefill(&mut sealer, 96, 4, hidden);
    assert!(inbound.check(&last, now).is_ok(), "96..100 fits");
    assert_eq!(inbound.credits(), Some(14), "refused frames take no credit");
}
