//! The runtime: sharded worker threads, IO backends (io_uring, epoll), listeners, the server.
