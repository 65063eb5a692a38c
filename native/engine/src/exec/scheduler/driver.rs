//! A scheduler stepped on a thread of its own, for as long as it has work.
//!
//! Stepping a scheduler from calls that each return the tokens so far
//! leaves the device idle at every call's end: the last step queued must be
//! read back, and the next call builds its first step from the host. The
//! driver's thread instead goes on decoding, one step queued ahead of the
//! one read, until a command arrives (a request, a cancellation) or a
//! waiting request can take a freed slot; each step's tokens go to a sink
//! as soon as they are read. Requests are checked and prepared (their
//! constraints compiled) on the caller's thread, so a bad request is the
//! caller's error at once and a slow grammar never holds the batch.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;

use super::*;

/// What the driver's thread hands its sink.
pub enum Output {
    /// New tokens of one or more requests (one event each), the slots'
    /// use after them, and the time since the sink's previous output.
    Events {
        events: Vec<Event>,
        occupancy: Occupancy,
        elapsed: Duration,
    },
    /// A step failed: the batch is in an unknown state, and every request
    /// it held is dropped.
    Failed(Error),
}

enum Command {
    Admit(Box<Request>),
    Cancel(Vec<RequestId>),
    ClearPrefixCache,
    /// Answered after the commands sent before it.
    Occupancy(mpsc::SyncSender<Occupancy>),
    Stop,
}

/// A decode loop's way out: `interrupt` is set when commands wait, and each
/// step's events go to the sink.
pub(crate) struct Driven<'a> {
    interrupt: &'a AtomicBool,
    sink: &'a mut dyn FnMut(Output) -> bool,
    last: Instant,
    /// The sink refused an output (its receiver is gone).
    closed: bool,
}

impl Driven<'_> {
    pub(crate) fn interrupted(&self) -> bool {
        self.closed || self.interrupt.load(Ordering::Acquire)
    }

    /// Hands the events gathered so far to the sink.
    pub(crate) fn flush(&mut self, events: &mut Vec<Event>, occupancy: Occupancy) {
        if events.is_empty() {
            return;
        }
        let now = Instant::now();
        let output = Output::Events {
            events: std::mem::take(events),
            occupancy,
            elapsed: now - self.last,
        };
        self.last = now;
        if !(self.sink)(output) {
            self.closed = true;
        }
    }
}

/// A [`Scheduler`] on a thread of its own (a pooled one). Dropping the
/// driver ends its loop after the current step; [`stop`](Self::stop) also
/// waits for that.
pub struct Driver {
    intake: Intake,
    /// Answers when the thread's loop has ended (in a mutex: a receiver is
    /// not shared between threads, the driver is).
    done: Mutex<Receiver<std::thread::Result<()>>>,
}

/// A driver's way in for commands, which works apart from the driver: a
/// caller that keeps the driver behind a lock takes a copy out and admits
/// through it, so that a slow grammar's compilation holds no lock.
#[derive(Clone)]
pub struct Intake {
    commands: Sender<Command>,
    interrupt: Arc<AtomicBool>,
    admission: Admission,
}

impl Intake {
    /// Checks and queues a request (compiling its constraint here); its
    /// tokens reach the driver's sink. Fails once the driver has stopped.
    pub fn admit(
        &self,
        prompt: Vec<u32>,
        options: GenerateOptions,
        constraint: Option<ConstraintSpec>,
    ) -> Result<RequestId> {
        let request = self.admission.prepare(prompt, options, constraint)?;
        let id = request.id;
        self.send(Command::Admit(Box::new(request)))?;
        Ok(id)
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands.send(command).map_err(|_| stopped())?;
        self.interrupt.store(true, Ordering::Release);
        Ok(())
    }
}

/// How long the driver's steps may hold a waiting prompt back.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    /// Most decode steps between two chunks of a prompt being prefilled.
    pub max_steps: usize,
    /// No decode step starts this long after a chunk while a prompt waits
    /// (`None`: `max_steps` alone).
    pub budget: Option<Duration>,
}

impl Driver {
    /// Moves `scheduler` onto a new thread that steps it while it has work
    /// and gives `sink` every output; the thread ends when the sink returns
    /// false or the driver is dropped.
    pub fn spawn(
        scheduler: Scheduler,
        pacing: Pacing,
        sink: impl FnMut(Output) -> bool + Send + 'static,
    ) -> Result<Driver> {
        let (commands, inbox) = mpsc::channel();
        let interrupt = Arc::new(AtomicBool::new(false));
        let admission = scheduler.admission();
        let done = {
            let interrupt = interrupt.clone();
            crate::runtime::device::on_pooled_thread(move || {
                run(scheduler, pacing, inbox, &interrupt, sink)
            })?
        };
        Ok(Driver {
            intake: Intake {
                commands,
                interrupt,
                admission,
            },
            done: Mutex::new(done),
        })
    }

    /// The driver's way in for requests (cloned, it admits apart from the
    /// driver).
    pub fn intake(&self) -> &Intake {
        &self.intake
    }

    /// Drops requests wherever they are, within one decode step.
    pub fn cancel(&self, ids: Vec<RequestId>) -> Result<()> {
        self.send(Command::Cancel(ids))
    }

    pub fn clear_prefix_cache(&self) -> Result<()> {
        self.send(Command::ClearPrefixCache)
    }

    /// The slots' use once the commands sent before are applied (within
    /// a step).
    pub fn occupancy(&self) -> Result<Occupancy> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.send(Command::Occupancy(reply))?;
        answer.recv().map_err(|_| stopped())
    }

    /// Stops the thread and waits for it (its current step ends first), so
    /// that the scheduler's memory is free on return.
    pub fn stop(self) {
        self.halt();
        let _ = self.done.lock().unwrap_or_else(|p| p.into_inner()).recv();
    }

    fn halt(&self) {
        let _ = self.intake.send(Command::Stop);
    }

    fn send(&self, command: Command) -> Result<()> {
        self.intake.send(command)
    }
}

impl Drop for Driver {
    // Not joined: a step in flight may take long, and the caller (a BEAM
    // destructor, say) should not wait for it.
    fn drop(&mut self) {
        self.halt();
    }
}

fn run(
    mut scheduler: Scheduler,
    pacing: Pacing,
    inbox: Receiver<Command>,
    interrupt: &AtomicBool,
    mut sink: impl FnMut(Output) -> bool,
) {
    let mut last = Instant::now();
    loop {
        // Idle: wait for a command rather than spin.
        let first = if scheduler.is_idle() {
            match inbox.recv() {
                Ok(command) => {
                    last = Instant::now();
                    Some(command)
                }
                Err(_) => return,
            }
        } else {
            None
        };
        let mut commands: Vec<Command> = first.into_iter().collect();
        if matches!(commands.first(), Some(Command::Admit(_))) {
            gather(&inbox, &mut commands);
        }
        // Cleared before the inbox is read, so that a command sent after
        // the read interrupts the next steps.
        interrupt.store(false, Ordering::Release);
        for command in commands.into_iter().chain(inbox.try_iter()) {
            match command {
                Command::Admit(request) => scheduler.queue.push_back(*request),
                Command::Cancel(ids) => {
                    for id in ids {
                        scheduler.cancel(id);
                    }
                }
                Command::ClearPrefixCache => scheduler.clear_prefix_cache(),
                Command::Occupancy(reply) => {
                    let _ = reply.send(scheduler.occupancy());
                }
                Command::Stop => return,
            }
        }
        if !scheduler.is_idle() {
            let mut events = vec![];
            let mut driven = Driven {
                interrupt,
                sink: &mut sink,
                last,
                closed: false,
            };
            let deadline = pacing.budget.map(|b| Instant::now() + b);
            let stepped = catch_unwind(AssertUnwindSafe(|| {
                scheduler.step_here(pacing.max_steps, deadline, Some(&mut driven), &mut events)
            }));
            let failure = match stepped {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error),
                Err(panic) => Some(Error::from_panic(&*panic)),
            };
            match failure {
                None => driven.flush(&mut events, scheduler.occupancy()),
                Some(error) => {
                    // Whatever the failed step held is dropped with it.
                    scheduler.queue.clear();
                    scheduler.prefill = None;
                    scheduler.slots.iter_mut().for_each(|s| *s = None);
                    driven.closed |= !(driven.sink)(Output::Failed(error));
                }
            }
            last = driven.last;
            if driven.closed {
                return;
            }
        }
    }
}

/// Requests that callers submit at once reach an idle driver a fraction of
/// a millisecond apart. Seated as they come, the first would be prefilled
/// alone and the others after it, a prefill later; so an idle driver given
/// a request takes the commands that follow while they keep coming, each
/// within `GATHER_GAP` of the last and all within `GATHER_MAX`, and seats
/// the requests together. A lone request waits `GATHER_GAP` once.
const GATHER_GAP: Duration = Duration::from_micros(250);
const GATHER_MAX: Duration = Duration::from_millis(2);

fn gather(inbox: &Receiver<Command>, commands: &mut Vec<Command>) {
    let until = Instant::now() + GATHER_MAX;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(GATHER_GAP.min(left)) {
            Ok(command) => {
                // These want an answer or the end now.
                let urgent = matches!(command, Command::Occupancy(_) | Command::Stop);
                commands.push(command);
                if urgent {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

fn stopped() -> Error {
    Error::Released("the scheduler's thread has stopped".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathering_takes_what_keeps_coming_and_stops_at_an_urgent_command() {
        let (send, inbox) = mpsc::channel();
        for _ in 0..3 {
            send.send(Command::ClearPrefixCache).unwrap();
        }
        let mut commands = vec![];
        let started = Instant::now();
        gather(&inbox, &mut commands);
        assert_eq!(commands.len(), 3);
        // It waited one gap past the last before giving up.
        assert!(started.elapsed() >= GATHER_GAP);

        send.send(Command::Cancel(vec![1])).unwrap();
        send.send(Command::Stop).unwrap();
        send.send(Command::ClearPrefixCache).unwrap();
        let mut commands = vec![];
        gather(&inbox, &mut commands);
        assert!(matches!(
            commands.as_slice(),
            [Command::Cancel(_), Command::Stop]
        ));
        assert_eq!(inbox.try_iter().count(), 1);

        // A sender that never stops is cut off after GATHER_MAX.
        let sender = std::thread::spawn(move || {
            let until = Instant::now() + GATHER_MAX * 100;
            while Instant::now() < until {
                if send.send(Command::ClearPrefixCache).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_micros(20));
            }
        });
        let started = Instant::now();
        gather(&inbox, &mut vec![]);
        assert!(started.elapsed() < GATHER_MAX * 25);
        drop(inbox);
        sender.join().unwrap();
    }
}
