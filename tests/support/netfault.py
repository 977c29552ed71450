"""A TCP relay in front of a Redis server that the tests break on purpose.

``Relay(port).url()`` is what a worker or a client uses instead of the server's own address.
Faults, each until ``heal()``:

* ``silence()``: nothing goes through either way any more, and nothing is closed (packets
  dropped on a link that went quiet); new connections are accepted and stay silent too.
* ``refuse()``: every connection is closed and new ones are refused (a server that is down).
* ``lose_reply(*markers, then="pass")``: the next request containing one of ``markers`` reaches
  the server, its reply never comes back and every connection is cut (then the relay passes
  again, or with ``then="refuse"`` refuses, as a server that died right after the call): a call
  that ran and whose reply was lost.  An error reply (``NOSCRIPT``: the call did not run) passes,
  and the next such request is the one.  :func:`script_call` gives a gate transition's markers.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.mode = "pass"  # pass, silent, refuse
        self.markers: tuple[bytes, ...] = ()
        self.then = "pass"  # the mode after a reply is lost
        self.lost = 0  # replies lost so far
        self._swallow: dict[int, tuple[bytes, ...]] = {}  # connection -> markers it matched
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # -- faults ---------------------------------------------------------------------------------
    def silence(self) -> None:
        self.mode = "silent"

    def refuse(self) -> None:
        self.mode = "refuse"
        self.cut()

    def lose_reply(self, *markers: bytes, then: str = "pass") -> None:
        self.markers, self.then = markers, then

    def heal(self) -> None:
        self.mode = "pass"

    def cut(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self.mode = "refuse"
        self.server.close()
        self.cut()

    # -- plumbing -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                if self.mode == "silent":
                    continue  # dropped
                markers = self.markers
                if markers and any(marker in data for marker in markers):
                    self.markers = ()
                    self._swallow[id(upstream)] = markers
                upstream.sendall(data)
        except OSError:
            pass

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                if self.mode == "silent":
                    continue
                markers = self._swallow.pop(id(upstream), None)
                if markers is not None and data.startswith(b"-"):
                    self.markers = markers  # it did not run: the next one
                elif markers is not None:
                    self.lost += 1
                    self.mode = self.then
                    self.cut()  # the request ran; its reply is gone with the connection
                    return
                client.sendall(data)
        except OSError:
            pass


def script_call(name: str) -> tuple[bytes, bytes]:
    """What a call of the gate's transition ``name`` carries, either way it is made: its
    function's name (FCALL) and its script's SHA1 (EVALSHA)."""
    import hashlib

    from celery_threads.gate import function_library, script_sources

    sha = hashlib.sha1(script_sources()[name].encode()).hexdigest()
    return function_library().functions[name].encode() + b"\r\n", sha.encode()
