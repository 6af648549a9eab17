//! A bounded channel built from loom's primitives with crossbeam's API and
//! error types, so loom explores every interleaving of send, drop and poll
//! of the runtime's awaitable reply channels.

use std::collections::VecDeque;

use crossbeam_channel::{SendError, TryRecvError, TrySendError};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};

struct Chan<T> {
    queue: Mutex<VecDeque<T>>,
    senders: AtomicUsize,
    capacity: usize,
}

pub struct Sender<T>(Arc<Chan<T>>);
pub struct Receiver<T>(Arc<Chan<T>>);

pub fn bounded<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    let chan = Arc::new(Chan {
        queue: Mutex::new(VecDeque::new()),
        senders: AtomicUsize::new(1),
        capacity,
    });
    (Sender(Arc::clone(&chan)), Receiver(chan))
}

impl<T> Sender<T> {
    pub fn try_send(&self, value: T) -> Result<(), TrySendError<T>> {
        let mut queue = self.0.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.len() >= self.0.capacity {
            return Err(TrySendError::Full(value));
        }
        queue.push_back(value);
        Ok(())
    }

    /// Loom cannot model a blocked sender; the models never fill a channel.
    pub fn send(&self, value: T) -> Result<(), SendError<T>> {
        self.try_send(value).map_err(|e| SendError(e.into_inner()))
    }

    pub fn len(&self) -> usize {
        self.0.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> Option<usize> {
        Some(self.0.capacity)
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.0.senders.fetch_add(1, Ordering::AcqRel);
        Sender(Arc::clone(&self.0))
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.0.senders.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T> Receiver<T> {
    pub fn try_recv(&self) -> Result<T, TryRecvError> {
        let mut queue = self.0.queue.lock().unwrap_or_else(|p| p.into_inner());
        match queue.pop_front() {
            Some(value) => Ok(value),
            None if self.0.senders.load(Ordering::Acquire) == 0 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }
}
