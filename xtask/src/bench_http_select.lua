-- wrk script of `cargo xtask bench http --wrk`: POSTs the bench's /select bodies (one JSON
-- document per line of the file given after `--`) in rotation, and prints one machine-read
-- summary line. Latencies are in microseconds.
local bodies = {}
local i = 0

function init(args)
  for line in io.lines(args[1]) do
    bodies[#bodies + 1] = line
  end
end

function request()
  i = i % #bodies + 1
  return wrk.format("POST", "/select", { ["Content-Type"] = "application/json" }, bodies[i])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVSELECT requests=%d duration_us=%d non2xx=%d socket_errors=%d p50=%d p99=%d p999=%d\n",
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
