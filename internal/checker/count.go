package checker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// count asks Options.CountURL how many resources exist for marker, with tenant
// A's headers (minus the request's Content-Type).
func (c *checker) count(ctx context.Context, marker string) (int, error) {
	u := strings.ReplaceAll(c.o.CountURL, "{{marker}}", marker)
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, err
	}
	for k, v := range c.o.Header {
		r.Header[k] = v
	}
	r.Header.Del("Content-Type")
	r.Header.Set("Accept", "application/json")
	r.Header.Set("User-Agent", "idem-check")
	resp, err := c.client.Do(r)
	if err != nil {
		return 0, fmt.Errorf("count URL: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return 0, fmt.Errorf("count URL: reading the answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("count URL %s answered %d, want 200: %s", u, resp.StatusCode, excerpt(body, 0, 200))
	}
	n, err := CountJSON(body, c.o.CountPath)
	if err != nil {
		return 0, fmt.Errorf("count URL %s: %w", u, err)
	}
	return n, nil
}

// CountJSON returns the count in a JSON document. With path "" it is the length
// of the first array in the document, in document order (the document itself
// when it is an array). Otherwise path is a dotted list of object members and
// array indexes ("data.items", "results.0.orders") leading to an array, whose
// length is the count, or to a non-negative integer, which is the count.
func CountJSON(doc []byte, path string) (int, error) {
	if path == "" {
		return firstArrayLen(doc)
	}
	var v any
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return 0, fmt.Errorf("the answer is not JSON: %v", err)
	}
	for _, seg := range strings.Split(path, ".") {
		switch x := v.(type) {
		case map[string]any:
			next, ok := x[seg]
			if !ok {
				return 0, fmt.Errorf("count path %q: no member %q in the answer", path, seg)
			}
			v = next
		case []any:
			i, err := strconv.Atoi(seg)
			if err != nil || i < 0 || i >= len(x) {
				return 0, fmt.Errorf("count path %q: %q is not an index of an array of %d", path, seg, len(x))
			}
			v = x[i]
		default:
			return 0, fmt.Errorf("count path %q: cannot look up %q in a %T", path, seg, v)
		}
	}
	switch x := v.(type) {
	case []any:
		return len(x), nil
	case json.Number:
		n, err := strconv.Atoi(x.String())
		if err != nil || n < 0 {
			return 0, fmt.Errorf("count path %q leads to %s, not a count", path, x)
		}
		return n, nil
	}
	return 0, fmt.Errorf("count path %q leads to a %T, want an array or a number", path, v)
}

// firstArrayLen returns the number of elements of the first array in doc.
func firstArrayLen(doc []byte) (int, error) {
	dec := json.NewDecoder(bytes.NewReader(doc))
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return 0, errors.New("the answer holds no JSON array; set a count path")
		}
		if err != nil {
			return 0, fmt.Errorf("the answer is not JSON: %v", err)
		}
		if tok == json.Delim('[') {
			break
		}
	}
	n := 0
	for dec.More() {
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return 0, fmt.Errorf("the answer is not JSON: %v", err)
		}
		n++
	}
	return n, nil
}
