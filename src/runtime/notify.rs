//! Reply channels that can be awaited: a bounded crossbeam channel paired
//! with a waker. A worker sends without ever blocking; an async gRPC handler
//! polls the receiving end and is woken by the send, so no completion-queue
//! thread ever blocks on a worker. Synchronous callers (tests, the CLI) use
//! the blocking `recv` family as with a plain crossbeam channel.
//!
//! Under `--cfg loom` the channel and the waker are loom's model-checked
//! stand-ins (`loom_shim` below), so `tests/loom` checks this very code for
//! lost wake-ups.

use std::mem::ManuallyDrop;
use std::task::{Context, Poll};
#[cfg(not(loom))]
use std::time::Instant;

#[cfg(not(loom))]
use crossbeam_channel::{RecvError, RecvTimeoutError};
use crossbeam_channel::{SendError, TryRecvError, TrySendError};

#[cfg(not(loom))]
use crossbeam_channel::{bounded, Receiver, Sender};
#[cfg(not(loom))]
use futures_util::task::AtomicWaker;
#[cfg(not(loom))]
use std::sync::Arc;

#[cfg(loom)]
use loom::future::AtomicWaker;
#[cfg(loom)]
use loom::sync::Arc;
#[cfg(loom)]
use loom_shim::{bounded, Receiver, Sender};

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
        #[cfg(not(loom))]
        self.waker.register(cx.waker());
        #[cfg(loom)]
        self.waker.register_by_ref(cx.waker());
        match self.rx.try_recv() {
            Ok(value) => Poll::Ready(Some(value)),
            Err(TryRecvError::Disconnected) => Poll::Ready(None),
            Err(TryRecvError::Empty) => Poll::Pending,
        }
    }
}

/// A bounded channel built from loom's primitives with crossbeam's API and
/// error types, so loom explores every interleaving of send, drop and poll.
#[cfg(loom)]
mod loom_shim {
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
                None if self.0.senders.load(Ordering::Acquire) == 0 => {
                    Err(TryRecvError::Disconnected)
                }
                None => Err(TryRecvError::Empty),
            }
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
