//! powerhub's binary frame transport over TCP.
