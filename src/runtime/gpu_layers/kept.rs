//! Which row of a GPU worker's kept-logits buffer holds which session's
//! next logits, and the sessions whose row was taken for another.

use std::collections::HashMap;

use crate::runtime::SessionId;

/// The rows' owners; see the module docs.
pub(super) struct KeptRows {
    owner: Vec<Option<SessionId>>,
    /// The step each row was last written or read in.
    last_used: Vec<u64>,
    by_session: HashMap<SessionId, u32>,
    /// Next logits of sessions whose row went to another, on the host.
    pub(super) evicted: HashMap<SessionId, Vec<f32>>,
    step: u64,
}

/// Where a session's next logits go this step.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Placed {
    /// Into this row (its own, or a free one).
    Row(u32),
    /// Into this row, whose owner's logits must be read out first.
    Taken { row: u32, from: SessionId },
    /// Every row is in use this step: to the host.
    Host,
}

impl KeptRows {
    pub(super) fn new(rows: usize) -> Self {
        Self {
            owner: vec![None; rows],
            last_used: vec![0; rows],
            by_session: HashMap::new(),
            evicted: HashMap::new(),
            step: 0,
        }
    }

    /// A new step begins: rows used from now on are not taken within it.
    pub(super) fn begin_step(&mut self) {
        self.step += 1;
    }

    /// The row `session`'s new logits go to: its own, a free one, or the
    /// one used longest ago outside this step (its owner's logits then
    /// have to be read out before the step runs).
    pub(super) fn place(&mut self, session: SessionId) -> Placed {
        self.evicted.remove(&session);
        if let Some(&row) = self.by_session.get(&session) {
            self.last_used[row as usize] = self.step;
            return Placed::Row(row);
        }
        let free = self.owner.iter().position(Option::is_none);
        let row = match free {
            Some(row) => row,
            None => {
                let oldest = (0..self.owner.len())
                    .filter(|&r| self.last_used[r] < self.step)
                    .min_by_key(|&r| self.last_used[r]);
                match oldest {
                    Some(row) => row,
                    None => return Placed::Host,
                }
            }
        };
        let from = self.owner[row].replace(session);
        self.last_used[row] = self.step;
        self.by_session.insert(session, row as u32);
        match from {
            Some(from) => {
                self.by_session.remove(&from);
                Placed::Taken {
                    row: row as u32,
                    from,
                }
            }
            None => Placed::Row(row as u32),
        }
    }

    /// The session's row, marked used this step.
    pub(super) fn touch(&mut self, session: SessionId) -> Option<u32> {
        let row = *self.by_session.get(&session)?;
        self.last_used[row as usize] = self.step;
        Some(row)
    }

    /// The session's row.
    pub(super) fn row(&self, session: SessionId) -> Option<u32> {
        self.by_session.get(&session).copied()
    }

    /// Forgets the session's logits, wherever they are.
    pub(super) fn release(&mut self, session: SessionId) {
        if let Some(row) = self.by_session.remove(&session) {
            self.owner[row as usize] = None;
        }
        self.evicted.remove(&session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> SessionId {
        SessionId::parse(&format!("{n:032x}")).expect("an id")
    }

    #[test]
    fn rows_are_reused_free_first_then_the_oldest_outside_the_step() {
        let mut rows = KeptRows::new(2);
        rows.begin_step();
        assert_eq!(rows.place(id(1)), Placed::Row(0));
        assert_eq!(rows.place(id(2)), Placed::Row(1));
        assert_eq!(rows.place(id(3)), Placed::Host, "both rows are this step's");
        rows.begin_step();
        assert_eq!(rows.place(id(2)), Placed::Row(1), "its own row again");
        assert_eq!(
            rows.place(id(3)),
            Placed::Taken {
                row: 0,
                from: id(1)
            }
        );
        assert_eq!(rows.row(id(1)), None);
        rows.release(id(3));
        rows.begin_step();
        assert_eq!(rows.place(id(4)), Placed::Row(0), "a released row is free");
    }

    #[test]
    fn new_logits_supersede_the_evicted_copy() {
        let mut rows = KeptRows::new(1);
        rows.evicted.insert(id(7), vec![1.0]);
        rows.begin_step();
        assert_eq!(rows.place(id(7)), Placed::Row(0));
        assert!(rows.evicted.is_empty());
    }
}
