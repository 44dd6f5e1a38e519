"""Opens N connections to a live server, half of them sending the start of a request's headers and
then nothing, and prints the server's open descriptors every 5 s for 60 s, then how many of the
begun ones got a 408: `python slow_connections.py PORT PID N` (raise `ulimit -n` first)."""
import socket, sys, time, psutil, urllib.request
port, pid, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
proc = psutil.Process(pid)
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port)); socks.append(s)
    if i % 2 == 0:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\nx-a: ")
print("opened", n, "server fds", proc.num_fds(), flush=True)
t0 = time.time()
print("health", urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status, round(time.time()-t0, 3))
while time.time() - t0 < 60:
    time.sleep(5)
    print(f"{time.time()-t0:5.1f}s server fds {proc.num_fds()}", flush=True)
got408 = sum(1 for s in socks[::2] if s.recv(100).startswith(b"HTTP/1.1 408"))
print("408s", got408, "of", len(socks[::2]))
