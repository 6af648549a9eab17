//! Reply channels that can be awaited: a bounded crossbeam channel paired
//! with a waker. A worker sends without ever blocking; an async gRPC handler
//! polls the receiving end and is woken by the send, so no completion-queue
//! thread ever blocks on a worker. Synchronous callers (tests, the CLI) use
//! the blocking `recv` family as with a plain crossbeam channel.
//!
//! The channel and the waker come from [`crate::sync`]: under `--cfg loom`
//! they are loom's model-checked stand-ins, so `tests/loom` checks this very
//! code for lost wake-ups.

use std::mem::ManuallyDrop;
use std::task::{Context, Poll};
#[cfg(not(loom))]
use std::time::Instant;

#[cfg(not(loom))]
use crossbeam_channel::{RecvError, RecvTimeoutError};
use crossbeam_channel::{SendError, TryRecvError, TrySendError};

use crate::sync::channel::{bounded, Receiver, Sender};
use crate::sync::{Arc, AtomicWaker};

/// A bounded channel whose receiver can be polled from a future.
pub fn channel<T>(capacity: usize) -> (NotifySender<T>, NotifyReceiver<T>) {
    let (tx, rx) = bounded(capacity);
    let waker = Arc::new(AtomicWaker::new());
    (
        NotifySender {
            tx: ManuallyDrop::new(tx),
            waker: Arc::clone(&waker),
        },
        NotifyReceiver { rx, waker },
    )
}

/// The sending half: every send, and the drop that disconnects, wakes the
/// task polling the receiver.
pub struct NotifySender<T> {
    // Dropped by hand so the disconnect happens BEFORE the wake: a receiver
    // woken first would still see a live sender and sleep forever.
    tx: ManuallyDrop<Sender<T>>,
    waker: Arc<AtomicWaker>,
}

impl<T> NotifySender<T> {
    /// Sends, waiting for room (reply channels are sized so this never waits).
    pub fn send(&self, value: T) -> Result<(), SendError<T>> {
        let sent = self.tx.send(value);
        self.waker.wake();
        sent
    }

    /// Sends only if there is room.
    pub fn try_send(&self, value: T) -> Result<(), TrySendError<T>> {
        let sent = self.tx.try_send(value);
        if sent.is_ok() {
            self.waker.wake();
        }
        sent
    }
}

// A queue depth for gauges; nothing asks whether it is empty.
#[allow(clippy::len_without_is_empty)]
impl<T> NotifySender<T> {
    /// Messages waiting to be received.
    pub fn len(&self) -> usize {
        self.tx.len()
    }

    /// The bound the channel was made with.
    pub fn capacity(&self) -> Option<usize> {
        self.tx.capacity()
    }
}

impl<T> Clone for NotifySender<T> {
    fn clone(&self) -> Self {
        Self {
            tx: ManuallyDrop::new(Sender::clone(&self.tx)),
            waker: Arc::clone(&self.waker),
        }
    }
}

impl<T> Drop for NotifySender<T> {
    fn drop(&mut self) {
        // SAFETY: `tx` is never used again; this is the only place it drops.
        unsafe { ManuallyDrop::drop(&mut self.tx) };
        self.waker.wake();
    }
}

/// The receiving half.
pub struct NotifyReceiver<T> {
    rx: Receiver<T>,
    waker: Arc<AtomicWaker>,
}

#[cfg(not(loom))]
impl<T> NotifyReceiver<T> {
    pub fn recv(&self) -> Result<T, RecvError> {
        self.rx.recv()
    }

    pub fn recv_deadline(&self, deadline: Instant) -> Result<T, RecvTimeoutError> {
        self.rx.recv_deadline(deadline)
    }

    #[cfg(test)]
    pub fn try_recv(&self) -> Result<T, TryRecvError> {
        self.rx.try_recv()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// The plain channel, for `select!` with other crossbeam channels.
    pub fn inner(&self) -> &Receiver<T> {
        &self.rx
    }
}

impl<T> NotifyReceiver<T> {
    /// `Ready(Some(v))` for a message, `Ready(None)` once every sender is
    /// gone and the channel is empty, `Pending` (with the task's waker
    /// registered) otherwise.
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        // Register before looking, so a send landing in between still wakes us.
        self.waker.register(cx.waker());
        match self.rx.try_recv() {
            Ok(value) => Poll::Ready(Some(value)),
            Err(TryRecvError::Disconnected) => Poll::Ready(None),
            Err(TryRecvError::Empty) => Poll::Pending,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::future::poll_fn;

    #[test]
    fn a_send_from_another_thread_wakes_the_awaiting_task() {
        let (tx, rx) = channel::<u32>(1);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            tx.send(7).expect("receiver alive");
            // Dropping here must wake the second poll.
        });
        let got = futures_executor::block_on(async {
            let first = poll_fn(|cx| rx.poll_recv(cx)).await;
            let second = poll_fn(|cx| rx.poll_recv(cx)).await;
            (first, second)
        });
        sender.join().expect("sender thread");
        assert_eq!(got, (Some(7), None));
    }

    #[test]
    fn a_full_channel_refuses_without_waking_or_blocking() {
        let (tx, rx) = channel::<u32>(1);
        tx.try_send(1).expect("room for one");
        assert!(matches!(tx.try_send(2), Err(TrySendError::Full(2))));
        assert_eq!(rx.try_recv(), Ok(1));
        assert!(rx.is_empty());
    }
}
