//! One TCP link's two tasks: a reader that hands frames to the process's event channel and
//! reports the link's end (closed, broken, malformed frame, or silent too long), and a writer
//! that sends what the process queues, batching frames per flush, with a heartbeat when quiet.
//!
//! The tasks run on the process's I/O runtime; the process's own loop runs on its main thread
//! and waits on a std channel, whose timed wait is precise to microseconds (tokio's timers
//! round up to the millisecond, which would add up to a millisecond of wall time, many model
//! milliseconds at a small time scale, to every instant a process waits for).

use super::wire::{Frame, FrameBody, LinkCodec};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

pub type Link = Framed<TcpStream, LinkCodec>;

/// Frames a process may queue for one link before the link counts as stuck.
pub const LINK_QUEUE_FRAMES: usize = 1 << 16;

/// Accepts connections on `listener` for as long as the process runs. Each connection's first
/// frame is read (within `within`) on a task of its own, so a silent or slow peer holds no
/// other up, and handed to `greet` with the link and the peer's address: the first frame
/// says who the peer is, and `greet` decides what the link becomes.
pub fn spawn_accept_loop(
    listener: tokio::net::TcpListener,
    within: Duration,
    greet: impl Fn(Link, std::net::SocketAddr, Result<Frame, super::LiveError>) + Clone + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            let Ok((stream, address)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            let greet = greet.clone();
            tokio::spawn(async move {
                let mut link = Framed::new(stream, LinkCodec::default());
                let first = next_frame(&mut link, within, &address.to_string()).await;
                greet(link, address, first);
            });
        }
    });
}

/// Reads `stream` until it ends, handing each frame but heartbeats to `to`. The end (with why)
/// is the last thing it hands over.
pub fn spawn_reader<E: Send + 'static>(
    mut stream: SplitStream<Link>,
    silence: Duration,
    to: SyncSender<E>,
    on_frame: impl Fn(Frame) -> E + Send + 'static,
    on_end: impl FnOnce(String) -> E + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let why = loop {
            match tokio::time::timeout(silence, stream.next()).await {
                Err(_) => break format!("silent for {} ms", silence.as_millis()),
                Ok(None) => break "connection closed".to_string(),
                Ok(Some(Err(e))) => break format!("refused the connection: {e}"),
                Ok(Some(Ok(Frame { body: FrameBody::Heartbeat, .. }))) => {}
                Ok(Some(Ok(frame))) => {
                    // A full channel holds this task (and the socket) back: the loop is behind.
                    if to.send(on_frame(frame)).is_err() {
                        return; // the process is ending
                    }
                }
            }
        };
        let _ = to.send(on_end(why));
    })
}

/// Sends what arrives on `frames` to `sink`, and a heartbeat after every quiet `heartbeat`.
/// When every sender of `frames` is gone it flushes and closes the connection; a write error
/// is handed to `to` as the link's end.
pub fn spawn_writer<E: Send + 'static>(
    mut sink: SplitSink<Link, Frame>,
    mut frames: mpsc::Receiver<Frame>,
    heartbeat: Duration,
    to: SyncSender<E>,
    on_end: impl FnOnce(String) -> E + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let result: std::io::Result<()> = async {
            loop {
                let next = tokio::time::timeout(heartbeat, frames.recv()).await;
                match next {
                    Err(_) => sink.send(Frame::new(FrameBody::Heartbeat)).await?,
                    Ok(None) => {
                        sink.close().await?;
                        return Ok(());
                    }
                    Ok(Some(frame)) => {
                        sink.feed(frame).await?;
                        // Whatever else is queued goes out in the same flush.
                        while let Ok(more) = frames.try_recv() {
                            sink.feed(more).await?;
                        }
                        sink.flush().await?;
                    }
                }
            }
        }
        .await;
        if let Err(e) = result {
            let _ = to.send(on_end(format!("sending failed: {e}")));
        }
    })
}

/// Reads the next frame, or says why there is none within `within`.
pub async fn next_frame(link: &mut Link, within: Duration, peer: &str) -> Result<Frame, super::LiveError> {
    let link_error = |what: String| super::LiveError::Link { peer: peer.to_string(), what };
    loop {
        match tokio::time::timeout(within, link.next()).await {
            Err(_) => return Err(link_error(format!("no answer within {} ms", within.as_millis()))),
            Ok(None) => return Err(link_error("connection closed".into())),
            Ok(Some(Err(e))) => return Err(link_error(e.to_string())),
            Ok(Some(Ok(Frame { body: FrameBody::Heartbeat, .. }))) => {}
            Ok(Some(Ok(frame))) => return Ok(frame),
        }
    }
}

/// Sends one frame now.
pub async fn send_frame(link: &mut Link, body: FrameBody, peer: &str) -> Result<(), super::LiveError> {
    link.send(Frame::new(body))
        .await
        .map_err(|e| super::LiveError::Link { peer: peer.to_string(), what: format!("sending failed: {e}") })
}

/// A process loop's wait: the next event from its links, or nothing once the schedule's head
/// is due (`next_release`) or `at_most` has passed; then whatever else has already arrived,
/// so that all of it is queued before anything released is handled. Appends to `into`.
pub fn gather<E>(
    events: &Receiver<E>,
    next_release: Option<std::time::Instant>,
    at_most: Duration,
    into: &mut Vec<E>,
) -> Result<(), super::LiveError> {
    let now = std::time::Instant::now();
    let wait = next_release.map_or(at_most, |r| r.saturating_duration_since(now)).min(at_most);
    match events.recv_timeout(wait) {
        Ok(e) => into.push(e),
        Err(RecvTimeoutError::Timeout) => {}
        Err(RecvTimeoutError::Disconnected) => {
            return Err(super::LiveError::Runtime("every link task ended".into()))
        }
    }
    while let Ok(e) = events.try_recv() {
        into.push(e);
    }
    Ok(())
}
