//! A spy transport for tests: records frames and closes, and can be told to fail, to return
//! `Pending` and complete later, or to panic.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use powerhub_plugin::{
    CloseReason, Completion, Frame, SendError, SendOutcome, Sink, SubscriberRef,
};

/// What the spy does with the next sends.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SpyMode {
    /// Record the frame and accept it.
    #[default]
    Accept,
    /// Record nothing and fail with [`SendError::Refused`] carrying this text.
    Fail(String),
    /// Record the frame and return `Pending`; complete it with [`SpySink::complete_next`] or
    /// [`SpySink::complete_all`].
    Pending,
    /// Panic inside `send`.
    Panic,
}

/// A frame the spy was handed.
#[derive(Debug, Clone)]
pub struct SpyFrame {
    /// The subscriber's id.
    pub subscriber: String,
    /// The subscriber's topic.
    pub topic: String,
    /// The frame, exactly as the hub handed it (same buffer).
    pub frame: Frame,
}

#[derive(Debug, Default)]
struct State {
    frames: Vec<SpyFrame>,
    closes: Vec<(String, CloseReason)>,
    mode: SpyMode,
    per_id: HashMap<String, SpyMode>,
    pending: VecDeque<(String, Completion)>,
    sends: u64,
}

/// A recording [`Sink`] for tests. Clones share the record.
///
/// ```
/// use powerhub::transport::{SpyMode, SpySink};
/// use powerhub_plugin::{Completion, Frame, SendOutcome, Sink, SubscriberRef};
///
/// let spy = SpySink::new();
/// spy.set_mode(SpyMode::Pending);
/// let out = spy.send(&SubscriberRef::new("a", "t"), Frame::from_static(b"x"), Completion::noop());
/// assert_eq!(out, SendOutcome::Pending);
/// assert_eq!(spy.pending(), 1);
/// assert_eq!(spy.complete_all(), 1);
/// assert_eq!(spy.frames().len(), 1);
/// ```
#[derive(Debug, Clone, Default)]
pub struct SpySink {
    state: Arc<Mutex<State>>,
}

impl SpySink {
    /// A spy that accepts everything.
    pub fn new() -> Self {
        SpySink::default()
    }

    /// Sets what every subscriber without its own mode gets.
    pub fn set_mode(&self, mode: SpyMode) {
        self.state.lock().mode = mode;
    }

    /// Sets what subscriber `id` gets, overriding the global mode.
    pub fn set_mode_for(&self, id: &str, mode: SpyMode) {
        self.state.lock().per_id.insert(id.to_owned(), mode);
    }

    /// Every frame recorded so far, in send order.
    pub fn frames(&self) -> Vec<SpyFrame> {
        self.state.lock().frames.clone()
    }

    /// The frames recorded for subscriber `id`.
    pub fn frames_for(&self, id: &str) -> Vec<Frame> {
        self.state
            .lock()
            .frames
            .iter()
            .filter(|f| f.subscriber == id)
            .map(|f| f.frame.clone())
            .collect()
    }

    /// Takes and clears the recorded frames.
    pub fn take_frames(&self) -> Vec<SpyFrame> {
        std::mem::take(&mut self.state.lock().frames)
    }

    /// Every close call so far: subscriber id and reason.
    pub fn closes(&self) -> Vec<(String, CloseReason)> {
        self.state.lock().closes.clone()
    }

    /// Calls to `send`, whatever their outcome.
    pub fn sends(&self) -> u64 {
        self.state.lock().sends
    }

    /// Sends waiting for completion.
    pub fn pending(&self) -> usize {
        self.state.lock().pending.len()
    }

    /// Completes the oldest pending send with `result`; `false` if none was pending.
    pub fn complete_next(&self, result: Result<(), SendError>) -> bool {
        let next = self.state.lock().pending.pop_front();
        match next {
            Some((_, done)) => {
                done.complete(result);
                true
            }
            None => false,
        }
    }

    /// Completes every pending send successfully (including ones made while completing);
    /// returns how many.
    pub fn complete_all(&self) -> usize {
        let mut n = 0;
        while self.complete_next(Ok(())) {
            n += 1;
        }
        n
    }
}

impl Sink for SpySink {
    fn send(&self, sub: &SubscriberRef, frame: Frame, done: Completion) -> SendOutcome {
        let mut st = self.state.lock();
        st.sends += 1;
        let mode = st.per_id.get(sub.id()).unwrap_or(&st.mode).clone();
        let record = SpyFrame {
            subscriber: sub.id().to_owned(),
            topic: sub.topic().to_owned(),
            frame,
        };
        match mode {
            SpyMode::Accept => {
                st.frames.push(record);
                SendOutcome::Accepted
            }
            SpyMode::Fail(why) => SendOutcome::Failed(SendError::Refused(why)),
            SpyMode::Pending => {
                st.frames.push(record);
                st.pending.push_back((sub.id().to_owned(), done));
                SendOutcome::Pending
            }
            SpyMode::Panic => {
                drop(st);
                panic!("spy transport told to panic for {}", sub.id());
            }
        }
    }

    fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
        self.state.lock().closes.push((sub.id().to_owned(), reason));
    }
}
