//! Futures of the hub's blocking operations ([`Hub::flush_async`](super::Hub::flush_async),
//! [`Hub::shutdown_async`](super::Hub::shutdown_async)) for async callers, without a runtime:
//! the operation runs on a thread of its own (it may wait for transports) and wakes the task's
//! `Waker` when it is done. A flush's thread holds the hub's internals, not a
//! [`Hub`](super::Hub) handle: a flush given up on does not keep the hub open once the caller
//! drops its last handle (that closes the hub, and the waiting flush returns `Closed`). A
//! shutdown's holds a handle until it closed the hub.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

use super::core::Inner;
use super::FlushError;

#[derive(Debug, Default)]
struct Slot {
    result: Option<Result<(), FlushError>>,
    waker: Option<Waker>,
}

/// The future of [`Hub::flush_async`](super::Hub::flush_async) or
/// [`Hub::shutdown_async`](super::Hub::shutdown_async): the operation's result. Dropping it does
/// not cancel the operation.
#[derive(Debug)]
#[must_use = "a future does nothing unless polled (the operation runs regardless)"]
pub struct HubTask {
    slot: Arc<Mutex<Slot>>,
}

impl HubTask {
    pub(super) fn spawn(
        inner: Arc<Inner>,
        op: impl FnOnce(&Inner) -> Result<(), FlushError> + Send + 'static,
    ) -> HubTask {
        let slot = Arc::new(Mutex::new(Slot::default()));
        let done = Arc::clone(&slot);
        let run = move || {
            let result = op(&inner);
            let waker = {
                let mut s = done.lock();
                s.result = Some(result);
                s.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("powerhub-hub-task".into())
            .spawn(run)
        {
            slot.lock().result = Some(Err(FlushError::Spawn(e.to_string())));
        }
        HubTask { slot }
    }
}

impl Future for HubTask {
    type Output = Result<(), FlushError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.slot.lock();
        match s.result.take() {
            Some(result) => Poll::Ready(result),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}
