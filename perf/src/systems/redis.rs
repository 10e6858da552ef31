//! Redis pub/sub over RESP2: `SUBSCRIBE`, pipelined `PUBLISH`, and a reader of `message` pushes.

use std::io;

use super::{find_end, request, Decoder, Stream, Wire};

/// The RESP wire of Redis pub/sub.
#[derive(Debug, Default)]
pub(crate) struct RedisWire;

fn bulk(out: &mut Vec<u8>, b: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(b.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(b);
    out.extend_from_slice(b"\r\n");
}

impl Wire for RedisWire {
    fn subscribe(&self, s: &mut dyn Stream, topic: &str) -> io::Result<Vec<u8>> {
        let mut cmd = b"*2\r\n".to_vec();
        bulk(&mut cmd, b"SUBSCRIBE");
        bulk(&mut cmd, topic.as_bytes());
        // The confirmation is `*3 $9 subscribe $len topic :1`.
        request(s, &cmd, "SUBSCRIBE confirmation", |b| {
            let start = memchr::memmem::find(b, b"subscribe\r\n")?;
            let colon = start + memchr::memchr(b':', &b[start..])?;
            find_end(&b[colon..], b"\r\n").map(|e| colon + e)
        })
    }

    fn hello_publisher(&self, _s: &mut dyn Stream) -> io::Result<()> {
        Ok(())
    }

    fn encode_publish(&self, topic: &str, msg: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(b"*3\r\n$7\r\nPUBLISH\r\n");
        bulk(out, topic.as_bytes());
        bulk(out, msg);
    }

    fn decoder(&self) -> Box<dyn Decoder> {
        Box::new(RespDecoder)
    }
}

/// Decodes `*3 $7 message $n topic $n payload` pushes.
#[derive(Debug)]
struct RespDecoder;

/// Parse `$<len>\r\n<bytes>\r\n` at the start of `b`: (payload range, total length).
fn parse_bulk(b: &[u8]) -> io::Result<Option<(usize, usize, usize)>> {
    if b.is_empty() {
        return Ok(None);
    }
    if b[0] != b'$' {
        return Err(io::Error::other(format!(
            "RESP: expected a bulk string, got {:?}",
            String::from_utf8_lossy(&b[..b.len().min(40)])
        )));
    }
    let Some(nl) = memchr::memchr(b'\n', b) else {
        return Ok(None);
    };
    let len: usize = std::str::from_utf8(&b[1..nl - 1])
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other("RESP: bad bulk length"))?;
    let start = nl + 1;
    let end = start + len + 2;
    if b.len() < end {
        return Ok(None);
    }
    Ok(Some((start, start + len, end)))
}

impl Decoder for RespDecoder {
    fn decode(
        &mut self,
        buf: &[u8],
        on_msg: &mut dyn FnMut(&[u8]),
        _reply: &mut Vec<u8>,
    ) -> io::Result<usize> {
        let mut pos = 0;
        loop {
            let b = &buf[pos..];
            if b.len() < 4 {
                return Ok(pos);
            }
            if !b.starts_with(b"*3\r\n") {
                return Err(io::Error::other(format!(
                    "RESP: unexpected push {:?}",
                    String::from_utf8_lossy(&b[..b.len().min(60)])
                )));
            }
            let mut at = 4;
            let mut payload = (0, 0);
            for _ in 0..3 {
                match parse_bulk(&b[at..])? {
                    Some((s, e, end)) => {
                        payload = (at + s, at + e);
                        at += end;
                    }
                    None => return Ok(pos),
                }
            }
            on_msg(&b[payload.0..payload.1]);
            pos += at;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_split_messages() {
        let w = RedisWire;
        let mut d = w.decoder();
        let stream = b"*3\r\n$7\r\nmessage\r\n$1\r\nt\r\n$5\r\nhello\r\n*3\r\n$7\r\nmessage\r\n$1\r\nt\r\n$2\r\nhi\r\n";
        let mut got = Vec::new();
        let mut reply = Vec::new();
        let n = d
            .decode(&stream[..30], &mut |m| got.push(m.to_vec()), &mut reply)
            .unwrap();
        assert_eq!(n, 0);
        let n = d
            .decode(stream, &mut |m| got.push(m.to_vec()), &mut reply)
            .unwrap();
        assert_eq!(n, stream.len());
        assert_eq!(got, vec![b"hello".to_vec(), b"hi".to_vec()]);
    }
}
