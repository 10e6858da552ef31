//! A custom transport written only against the public API, served by an in-process engine.
//!
//! Both plugin shapes:
//!
//! 1. A **stream protocol** (`lpjson`: every JSON message is prefixed by its length as a 4-byte
//!    big-endian integer), registered by name and named by a listener. The engine's shards own
//!    the sockets; the plugin only frames bytes.
//! 2. A **sink** that owns its IO (here: it counts what it is handed), subscribed to the engine's
//!    hub directly.
//!
//! A thread of the "service" publishes into the engine's hub; a client speaking `lpjson` over
//! loopback subscribes and reads. The example exits by itself.
//!
//! Run: `cargo run --example custom_transport`

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use powerhub::hub::{Message, PublishOptions, SubscribeOptions};
use powerhub::plugin::{
    BytesMut, Completion, Frame, Inbound, ProtocolError, ProtocolFactory, ProtocolLimits,
    ProtocolOutput, SendOutcome, Sink, StreamProtocol, SubscriberRef,
};
use powerhub::runtime::{Config, Engine, ListenAddr, ListenerConfig, ProtocolRegistry};

/// Length-prefixed JSON: `u32` big-endian length, then the message.
#[derive(Debug)]
struct LpJson {
    max: usize,
}

impl StreamProtocol for LpJson {
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        while input.len() >= 4 {
            let len = u32::from_be_bytes([input[0], input[1], input[2], input[3]]) as usize;
            if len > self.max {
                return Err(ProtocolError::TooLarge {
                    what: "message",
                    limit_name: "max_message_bytes",
                    size: len,
                    limit: self.max,
                });
            }
            if input.len() < 4 + len {
                break;
            }
            let _ = input.split_to(4);
            out.events.push(Inbound::Text(input.split_to(len).freeze()));
        }
        Ok(())
    }

    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        out.extend_from_slice(&(json.len() as u32).to_be_bytes());
        out.extend_from_slice(json);
    }

    fn name(&self) -> &str {
        "lpjson"
    }
}

#[derive(Debug)]
struct LpJsonFactory;

impl ProtocolFactory for LpJsonFactory {
    fn name(&self) -> &str {
        "lpjson"
    }

    fn new_connection(&self, limits: &ProtocolLimits) -> Box<dyn StreamProtocol> {
        Box::new(LpJson {
            max: limits.max_message_bytes,
        })
    }
}

/// A sink that owns its IO: it just counts bytes.
#[derive(Debug, Default)]
struct CountingSink(AtomicUsize);

impl Sink for CountingSink {
    fn send(&self, _sub: &SubscriberRef, frame: Frame, _done: Completion) -> SendOutcome {
        self.0.fetch_add(frame.len(), Ordering::Relaxed);
        SendOutcome::Accepted
    }
}

fn send_lp(stream: &mut TcpStream, json: &str) -> std::io::Result<()> {
    stream.write_all(&(json.len() as u32).to_be_bytes())?;
    stream.write_all(json.as_bytes())
}

fn read_lp(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut body)?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = ProtocolRegistry::with_builtins();
    registry.register(Arc::new(LpJsonFactory))?;
    let mut config = Config::default();
    config.engine.shards = 2;
    config
        .listeners
        .push(ListenerConfig::tcp("lpjson", "127.0.0.1:0"));
    let engine = Engine::start(config, &registry)?;
    let ListenAddr::Tcp(addr) = engine.listeners()[0].addr.clone() else {
        unreachable!("a TCP listener")
    };
    println!("lpjson on {addr}, backend {}", engine.backend());

    // The sink shape: a subscription whose transport is our own sink.
    let counting = Arc::new(CountingSink::default());
    let _sub = engine.hub().subscribe(
        "ticks",
        |_| {},
        SubscribeOptions::default()
            .id("counter")
            .sink(counting.clone()),
    )?;

    // The stream-protocol shape: a client over loopback.
    let mut client = TcpStream::connect(addr)?;
    send_lp(
        &mut client,
        r#"{"type":"subscribe","id":"r1","stream":"ticks"}"#,
    )?;
    println!("client <- {}", read_lp(&mut client)?);

    // The service publishes from its own thread.
    let hub = engine.hub().clone();
    let publisher = std::thread::spawn(move || -> Result<(), powerhub::hub::HubError> {
        for seq in 0..5 {
            let m = Message::json(format!(r#"{{"type":"tick","stream":"ticks","seq":{seq}}}"#))?;
            hub.publish("ticks", m, PublishOptions::default())?;
        }
        Ok(())
    });
    publisher.join().expect("publisher thread")?;
    for _ in 0..5 {
        let msg = read_lp(&mut client)?;
        println!("client <- {msg}");
    }
    engine.hub().flush()?;
    println!(
        "counting sink took {} bytes",
        counting.0.load(Ordering::Relaxed)
    );
    println!("engine stats: {:?}", engine.stats());
    engine.shutdown()?;
    Ok(())
}
