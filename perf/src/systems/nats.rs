//! NATS core protocol: `CONNECT`, `SUB`, pipelined `PUB`, and a reader of `MSG` that answers
//! server `PING`s.

use std::io;

use super::{find_end, read_until, request, Decoder, Stream, Wire};

/// The text wire of NATS.
#[derive(Debug, Default)]
pub(crate) struct NatsWire;

const CONNECT: &[u8] = b"CONNECT {\"verbose\":false,\"pedantic\":false,\"echo\":false}\r\n";

fn read_info(s: &mut dyn Stream) -> io::Result<()> {
    let mut buf = Vec::new();
    read_until(s, &mut buf, "NATS INFO", |b| find_end(b, b"\r\n")).map(drop)
}

impl Wire for NatsWire {
    fn subscribe(&self, s: &mut dyn Stream, topic: &str) -> io::Result<Vec<u8>> {
        read_info(s)?;
        let mut cmd = CONNECT.to_vec();
        cmd.extend_from_slice(format!("SUB {topic} 1\r\nPING\r\n").as_bytes());
        // The PONG proves the server processed the SUB before it.
        request(s, &cmd, "NATS PONG after SUB", |b| {
            if memchr::memmem::find(b, b"-ERR").is_some() {
                return Some(0);
            }
            find_end(b, b"PONG\r\n")
        })
        .and_then(|rest| {
            if memchr::memmem::find(&rest, b"-ERR").is_some() {
                Err(io::Error::other(
                    String::from_utf8_lossy(&rest).into_owned(),
                ))
            } else {
                Ok(rest)
            }
        })
    }

    fn hello_publisher(&self, s: &mut dyn Stream) -> io::Result<()> {
        read_info(s)?;
        let mut cmd = CONNECT.to_vec();
        cmd.extend_from_slice(b"PING\r\n");
        request(s, &cmd, "NATS PONG", |b| find_end(b, b"PONG\r\n")).map(drop)
    }

    fn encode_publish(&self, topic: &str, msg: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(b"PUB ");
        out.extend_from_slice(topic.as_bytes());
        out.push(b' ');
        out.extend_from_slice(msg.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(msg);
        out.extend_from_slice(b"\r\n");
    }

    fn decoder(&self) -> Box<dyn Decoder> {
        Box::new(MsgDecoder)
    }
}

/// Decodes `MSG <subject> <sid> [reply] <len>\r\n<payload>\r\n`, `PING`, `+OK`, `INFO`.
#[derive(Debug)]
struct MsgDecoder;

impl Decoder for MsgDecoder {
    fn decode(
        &mut self,
        buf: &[u8],
        on_msg: &mut dyn FnMut(&[u8]),
        reply: &mut Vec<u8>,
    ) -> io::Result<usize> {
        let mut pos = 0;
        loop {
            let b = &buf[pos..];
            let Some(nl) = memchr::memchr(b'\n', b) else {
                return Ok(pos);
            };
            let line = &b[..nl.saturating_sub(1)];
            if line.starts_with(b"MSG ") {
                let len_at = memchr::memrchr(b' ', line).unwrap_or(0) + 1;
                let len: usize = std::str::from_utf8(&line[len_at..])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| io::Error::other("NATS: bad MSG length"))?;
                let start = nl + 1;
                let end = start + len + 2;
                if b.len() < end {
                    return Ok(pos);
                }
                on_msg(&b[start..start + len]);
                pos += end;
            } else if line.starts_with(b"PING") {
                reply.extend_from_slice(b"PONG\r\n");
                pos += nl + 1;
            } else if line.starts_with(b"-ERR") {
                return Err(io::Error::other(format!(
                    "NATS: {}",
                    String::from_utf8_lossy(line)
                )));
            } else {
                // +OK, PONG, INFO: nothing to do.
                pos += nl + 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_msgs_and_answers_ping() {
        let w = NatsWire;
        let mut d = w.decoder();
        let stream = b"MSG t 1 5\r\nhello\r\nPING\r\nMSG t 1 2\r\nhi\r\nMSG t 1 9\r\nabc";
        let mut got = Vec::new();
        let mut reply = Vec::new();
        let n = d
            .decode(stream, &mut |m| got.push(m.to_vec()), &mut reply)
            .unwrap();
        assert_eq!(got, vec![b"hello".to_vec(), b"hi".to_vec()]);
        assert_eq!(reply, b"PONG\r\n");
        assert_eq!(&stream[n..], b"MSG t 1 9\r\nabc");
    }
}
