// Command score is a kvredis router read path in Go with nothing but the standard library:
// it computes block keys from token ids (kvredis's default xxh3_64 scheme, or llm-d's
// fnv64a_cbor), checks them against the scheme the namespace records, and scores them against a
// kvredis index in Redis or Valkey by calling the kvredis function library (FCALL_RO
// kvredis_score), speaking RESP over a plain TCP connection. docs/protocol.md is the contract it
// follows.
//
//	go run . -addr 127.0.0.1:6379 -namespace NS -model M -tokens 1,2,3,... -weights gpu=1,cpu=0.8
//
// It prints one JSON object: the block keys (decimal strings), each pod's score (its best
// data-parallel rank's) and each pod's per-rank scores, as the exact text the function replied
// ("%.17g"), which parses to the same float64 the Python client gets. With -keys-only it prints
// the keys without asking a server.
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

// The protocol this client speaks (docs/protocol.md): the function API and the key layout.
const (
	apiVersion    = 3
	layoutVersion = "kvredis-kvblock/2"
)

// apiArgument is the last argument of every function call: the api this client speaks (a
// library of another api refuses the call with KVREDIS_VERSION instead of misreading it).
var apiArgument = []byte(fmt.Sprintf("kvredis-api:%d", apiVersion))

// ---- RESP2 over net ----

type conn struct {
	c net.Conn
	r *bufio.Reader
}

// redisError is an error reply; its first word is the code (KVREDIS_STALE, NOPERM, ...).
type redisError string

func (e redisError) Error() string { return string(e) }

func (e redisError) code() string { return strings.SplitN(string(e), " ", 2)[0] }

func dial(addr string, timeout time.Duration) (*conn, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, err
	}
	return &conn{c: c, r: bufio.NewReader(c)}, nil
}

func (c *conn) do(args ...[]byte) (interface{}, error) {
	out := []byte("*" + strconv.Itoa(len(args)) + "\r\n")
	for _, a := range args {
		out = append(out, "$"+strconv.Itoa(len(a))+"\r\n"...)
		out = append(out, a...)
		out = append(out, "\r\n"...)
	}
	if _, err := c.c.Write(out); err != nil {
		return nil, err
	}
	return c.read()
}

func (c *conn) line() (string, error) {
	s, err := c.r.ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSuffix(s, "\r\n"), nil
}

// read returns a reply: string (simple), redisError, int64, []byte or nil (bulk), []interface{}.
func (c *conn) read() (interface{}, error) {
	head, err := c.line()
	if err != nil {
		return nil, err
	}
	if head == "" {
		return nil, errors.New("empty RESP line")
	}
	body := head[1:]
	switch head[0] {
	case '+':
		return body, nil
	case '-':
		return redisError(body), nil
	case ':':
		return strconv.ParseInt(body, 10, 64)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return nil, err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return nil, err
		}
		return buf[:n], nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return nil, err
		}
		items := make([]interface{}, n)
		for i := range items {
			if items[i], err = c.read(); err != nil {
				return nil, err
			}
		}
		return items, nil
	}
	return nil, fmt.Errorf("unexpected RESP type %q", head[0])
}

func b(s string) []byte { return []byte(s) }

// call sends a command and turns an error reply into an error.
func (c *conn) call(args ...[]byte) (interface{}, error) {
	reply, err := c.do(args...)
	if err != nil {
		return nil, err
	}
	if e, ok := reply.(redisError); ok {
		return nil, e
	}
	return reply, nil
}

func text(v interface{}) string {
	switch x := v.(type) {
	case []byte:
		return string(x)
	case string:
		return x
	case int64:
		return strconv.FormatInt(x, 10)
	}
	return ""
}

// ---- the kvredis protocol ----

type namespace struct {
	name, gen, bits string
}

// checkLibrary asks kvredis_version: [library, api, layout, release, build].
func checkLibrary(c *conn) error {
	reply, err := c.call(b("FCALL_RO"), b("kvredis_version"), b("0"))
	if err != nil {
		return fmt.Errorf("kvredis_version: %w (load the library: kvredis functions load)", err)
	}
	v, ok := reply.([]interface{})
	if !ok || len(v) < 5 {
		return fmt.Errorf("unexpected kvredis_version reply %v", reply)
	}
	if api, _ := v[1].(int64); api != apiVersion {
		return fmt.Errorf("the server's kvredis library speaks api %v, this client %d", v[1], apiVersion)
	}
	if text(v[2]) != layoutVersion {
		return fmt.Errorf("the library's layout is %s, this client reads %s", text(v[2]), layoutVersion)
	}
	return nil
}

// loadNamespace reads <ns>:meta (layout, bucket_bits, gen, scheme) with a plain HMGET, and
// checks that the namespace holds keys of this client's scheme (when it records one).
func loadNamespace(c *conn, name string, ours scheme) (namespace, error) {
	reply, err := c.call(b("HMGET"), b(name+":meta"), b("layout"), b("bucket_bits"), b("gen"), b("scheme"))
	if err != nil {
		return namespace{}, err
	}
	v, _ := reply.([]interface{})
	if len(v) != 4 || v[0] == nil || v[1] == nil || v[2] == nil {
		return namespace{}, fmt.Errorf("namespace %q does not exist", name)
	}
	if recorded := text(v[3]); v[3] != nil && recorded != ours.text() {
		return namespace{}, fmt.Errorf("namespace %q holds block keys of scheme %s, but this client "+
			"computes %s: its scores would all be empty; give -hash-algo, -block-size and -hash-seed "+
			"as the namespace's writers use them", name, describe(recorded), ours)
	}
	if text(v[0]) != layoutVersion {
		return namespace{}, fmt.Errorf("namespace %q has layout %s, not %s", name, text(v[0]), layoutVersion)
	}
	if strings.HasPrefix(text(v[2]), "dropping:") {
		return namespace{}, fmt.Errorf("namespace %q is being dropped", name)
	}
	return namespace{name: name, gen: text(v[2]), bits: text(v[1])}, nil
}

type weight struct {
	tier  string
	value float64
}

// scoreKeysPerCall is the most request keys one kvredis_score call is sent by default (the
// Python client's SCORE_KEYS_PER_CALL): a longer chain is scored in parts.
const scoreKeysPerCall = 4096

// slotScore is a (pod, data-parallel rank)'s score so far, as the exact text the function
// replied ("%.17g"), and the stamp that carries it to the chain's next part.
type slotScore struct {
	pod   string
	rank  int64
	score string
	stamp string
}

// score calls FCALL_RO kvredis_score over the chain, one part of at most perCall keys per call.
// A reply is [walked, cut, then pod, rank, score, still-in, stamp per (pod, rank)]; the next
// part is sent only while one still holds every key walked and the walk reached the part's end
// (or stopped at its work limit, cut = 1), and it carries those still in with their ranks,
// scores so far and stamps (a stamp that no longer holds leaves its score as it was). A (pod,
// rank)'s final score is the last one any reply gave it; they keep their order of first
// appearance.
func score(c *conn, ns namespace, keys []uint64, weights []weight, unknown float64, perCall int) ([]slotScore, error) {
	chain := make([]byte, 0, 8*len(keys))
	for _, k := range keys {
		chain = binary.BigEndian.AppendUint64(chain, k)
	}
	fixed := [][]byte{
		b("FCALL_RO"), b("kvredis_score"), b("4"),
		b(ns.name + ":meta"), b(ns.name + ":pi"), b(ns.name + ":pp"), b(ns.name + ":sx"),
		b(ns.gen), b(ns.name + ":r:"), b(ns.bits),
		b("0"), // no pod filter
		b(strconv.Itoa(len(weights))),
	}
	for _, w := range weights {
		fixed = append(fixed, b(w.tier), b(strconv.FormatFloat(w.value, 'g', -1, 64)))
	}
	fixed = append(fixed, b(strconv.FormatFloat(unknown, 'g', -1, 64)))
	var out []slotScore
	type slot struct {
		pod  string
		rank int64
	}
	at := map[slot]int{} // (pod, rank) -> its index in out
	carried := [][]byte{b("0")}
	for start := 0; start < len(keys); {
		end := start + perCall
		if end > len(keys) {
			end = len(keys)
		}
		more := "0"
		if end < len(keys) {
			more = "1"
		}
		args := append(append([][]byte{}, fixed...), chain[8*start:8*end], b(more))
		args = append(append(args, carried...), apiArgument)
		reply, err := c.call(args...)
		if err != nil {
			return nil, err
		}
		v, _ := reply.([]interface{})
		if len(v) < 2 || (len(v)-2)%5 != 0 {
			return nil, fmt.Errorf("unexpected kvredis_score reply %v", reply)
		}
		walked, _ := v[0].(int64)
		cut, _ := v[1].(int64)
		var live []slotScore
		for i := 2; i+4 < len(v); i += 5 {
			rank, _ := v[i+1].(int64)
			s := slotScore{text(v[i]), rank, text(v[i+2]), text(v[i+4])}
			key := slot{s.pod, s.rank}
			if j, ok := at[key]; ok {
				out[j] = s
			} else {
				at[key] = len(out)
				out = append(out, s)
			}
			if in, _ := v[i+3].(int64); in == 1 {
				live = append(live, s)
			}
		}
		if len(live) == 0 || walked == 0 || (int(walked) < end-start && cut == 0) {
			break // none left, or a key none holds
		}
		start += int(walked)
		carried = [][]byte{b(strconv.Itoa(len(live)))}
		for _, s := range live {
			carried = append(carried, b(s.pod), b(strconv.FormatInt(s.rank, 10)), b(s.score), b(s.stamp))
		}
	}
	return out, nil
}

func parseTokens(s string) ([]uint64, error) {
	if s == "-" {
		data, err := io.ReadAll(os.Stdin)
		if err != nil {
			return nil, err
		}
		s = string(data)
	}
	fields := strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '[' || r == ']' })
	tokens := make([]uint64, 0, len(fields))
	for _, f := range fields {
		t, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("token %q: %w", f, err)
		}
		tokens = append(tokens, t)
	}
	return tokens, nil
}

func parseWeights(s string) ([]weight, error) {
	var out []weight
	for _, item := range strings.Split(s, ",") {
		if item == "" {
			continue
		}
		tier, value, ok := strings.Cut(item, "=")
		w, err := strconv.ParseFloat(value, 64)
		if !ok || err != nil {
			return nil, fmt.Errorf("weight %q: want tier=number", item)
		}
		out = append(out, weight{tier, w})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].tier < out[j].tier })
	return out, nil
}

func run() error {
	addr := flag.String("addr", "127.0.0.1:6379", "Redis/Valkey host:port")
	user := flag.String("user", "", "ACL user (AUTH)")
	password := flag.String("password", os.Getenv("KVREDIS_REDIS_PASSWORD"), "password (env KVREDIS_REDIS_PASSWORD)")
	ns := flag.String("namespace", "kvblock", "kvredis namespace")
	model := flag.String("model", "", "model name (the root of the block-key chain)")
	algo := flag.String("hash-algo", "xxh3_64", "block key scheme: xxh3_64 or fnv64a_cbor")
	seed := flag.String("hash-seed", "", "hash seed of the block keys")
	blockSize := flag.Int("block-size", 16, "tokens per block")
	keysOnly := flag.Bool("keys-only", false, "print the block keys only (no server)")
	digests := flag.Bool("xxh3-digests", false,
		"check mode: read 'SEED HEX' lines on stdin, print XXH3-64 of each as 16 hex digits")
	tokenText := flag.String("tokens", "-", "token ids, comma or space separated (- for stdin)")
	weightText := flag.String("weights", "gpu=1,cpu=0.8", "tier weights, tier=number,...")
	unknown := flag.Float64("unknown-weight", 1.0, "weight of a tier not in -weights")
	perCall := flag.Int("keys-per-call", scoreKeysPerCall, "most block keys sent in one kvredis_score call")
	flag.Parse()
	if *digests {
		return printDigests(os.Stdin, os.Stdout)
	}
	if *model == "" || *blockSize <= 0 || *perCall <= 0 {
		return errors.New("-model, a positive -block-size and a positive -keys-per-call are required")
	}
	tokens, err := parseTokens(*tokenText)
	if err != nil {
		return err
	}
	ours := scheme{*algo, *blockSize, *seed}
	keys, err := ours.blockKeys(*model, tokens)
	if err != nil {
		return err
	}
	if *keysOnly {
		return printResult(keys, nil)
	}
	weights, err := parseWeights(*weightText)
	if err != nil {
		return err
	}
	c, err := dial(*addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.c.Close()
	if *password != "" {
		auth := [][]byte{b("AUTH"), b(*password)}
		if *user != "" {
			auth = [][]byte{b("AUTH"), b(*user), b(*password)}
		}
		if _, err := c.call(auth...); err != nil {
			return err
		}
	}
	if err := checkLibrary(c); err != nil {
		return err
	}
	var scores []slotScore
	for attempt := 0; ; attempt++ {
		space, err := loadNamespace(c, *ns, ours)
		if err != nil {
			return err
		}
		if len(keys) == 0 {
			break
		}
		scores, err = score(c, space, keys, weights, *unknown, *perCall)
		var re redisError
		if errors.As(err, &re) && re.code() == "KVREDIS_STALE" && attempt == 0 {
			continue // the namespace was recreated: read its meta record again
		}
		if err != nil {
			return err
		}
		break
	}
	return printResult(keys, scores)
}

func printResult(keys []uint64, scores []slotScore) error {
	out := struct {
		Keys   []string                     `json:"keys"`
		Scores map[string]string            `json:"scores"`
		Ranks  map[string]map[string]string `json:"ranks"`
	}{Keys: make([]string, len(keys)), Scores: map[string]string{}, Ranks: map[string]map[string]string{}}
	for i, k := range keys {
		out.Keys[i] = strconv.FormatUint(k, 10)
	}
	best := map[string]float64{}
	for _, s := range scores {
		// a pod's score is its best rank's
		value, err := strconv.ParseFloat(s.score, 64)
		if err != nil {
			return fmt.Errorf("score %q of pod %s: %w", s.score, s.pod, err)
		}
		if old, ok := best[s.pod]; !ok || value > old {
			best[s.pod] = value
			out.Scores[s.pod] = s.score
		}
		if out.Ranks[s.pod] == nil {
			out.Ranks[s.pod] = map[string]string{}
		}
		out.Ranks[s.pod][strconv.FormatInt(s.rank, 10)] = s.score
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// describe shows a recorded scheme ("<algo>:<block size>:<seed>") as scheme.String does.
func describe(recorded string) string {
	parts := strings.SplitN(recorded, ":", 3)
	if len(parts) == 3 {
		if size, err := strconv.Atoi(parts[1]); err == nil {
			return scheme{parts[0], size, parts[2]}.String()
		}
	}
	return strconv.Quote(recorded)
}

// printDigests reads "SEED HEX" lines (seed in decimal, the message in hex) and prints the
// XXH3-64 digest of each message as 16 hex digits, one per line.
func printDigests(in io.Reader, out io.Writer) error {
	lines := bufio.NewScanner(in)
	lines.Buffer(make([]byte, 1<<20), 1<<24)
	w := bufio.NewWriter(out)
	for lines.Scan() {
		seedText, msgHex, _ := strings.Cut(lines.Text(), " ")
		seed, err := strconv.ParseUint(seedText, 10, 64)
		if err != nil {
			return err
		}
		msg, err := hex.DecodeString(msgHex)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "%016x\n", xxh3(msg, seed))
	}
	if err := lines.Err(); err != nil {
		return err
	}
	return w.Flush()
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
