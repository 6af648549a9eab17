//! A Generate's compiled output constraint on its way from the front door
//! to the worker that runs the call (which takes it, once: the constraint
//! holds the call's place in its grammar).

use std::sync::{Arc, Mutex};

use crate::constraint::Constraint;

/// A compiled constraint on its way to the worker that runs the Generate
/// (which takes it, once: it holds the call's place in the grammar).
#[derive(Clone)]
pub struct RequestConstraint(Arc<Mutex<Option<Constraint>>>);

impl RequestConstraint {
    pub fn new(constraint: Constraint) -> Self {
        Self(Arc::new(Mutex::new(Some(constraint))))
    }

    /// The constraint, the first time; `None` after.
    pub fn take(&self) -> Option<Constraint> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for RequestConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestConstraint")
    }
}

impl PartialEq for RequestConstraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
