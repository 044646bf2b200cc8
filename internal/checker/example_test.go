package checker_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/idemkit/idem/internal/checker"
	"github.com/idemkit/idem/internal/checker/checkertest"
)

// Run checks an orders endpoint built with idem: every case passes.
func Example() {
	srv := checkertest.NewServer(checkertest.Correct)
	defer srv.Close()

	rep, err := checker.Run(context.Background(), checker.Options{
		URL:           srv.URL + "/orders",
		Header:        http.Header{"Authorization": {"Bearer tenant-a"}},
		TenantBHeader: http.Header{"Authorization": {"Bearer tenant-b"}},
		CountURL:      srv.URL + "/orders?cart_id={{marker}}",
		Concurrency:   10,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, c := range rep.Cases {
		fmt.Println(c.Name, c.Result)
	}
	fmt.Println("failed:", rep.Failed())
	// Output:
	// first_request pass
	// replay pass
	// changed_body pass
	// new_key pass
	// missing_key pass
	// long_key pass
	// hangup pass
	// race pass
	// tenant_isolation pass
	// failed: false
}

// Run finds the check-then-write race of the first source article.
func Example_checkThenWrite() {
	srv := checkertest.NewServer(checkertest.CheckThenWrite)
	defer srv.Close()

	rep, err := checker.Run(context.Background(), checker.Options{
		URL:         srv.URL + "/orders",
		Header:      http.Header{"Authorization": {"Bearer tenant-a"}},
		CountURL:    srv.URL + "/orders?cart_id={{marker}}",
		Concurrency: 5,
		Only:        []string{checker.CaseRace},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	race := rep.Case(checker.CaseRace)
	fmt.Println(race.Result, strings.HasSuffix(race.Summary, "the operation ran more than once"))
	fmt.Println(rep.Failed())
	// Output:
	// fail true
	// true
}

func ExampleCountJSON() {
	n, err := checker.CountJSON([]byte(`{"page":1,"orders":[{"id":"ord_1"},{"id":"ord_2"}]}`), "")
	fmt.Println(n, err)
	n, err = checker.CountJSON([]byte(`{"data":{"total":7}}`), "data.total")
	fmt.Println(n, err)
	// Output:
	// 2 <nil>
	// 7 <nil>
}
