// Command gin serves POST /orders with Gin, idem in front of the handler
// through a small adapter (gin.WrapH wraps a final handler, not a middleware),
// and the tenant from a Gin authentication middleware.
//
//	go run ./examples/routers/gin
package main

import (
	"bufio"
	"errors"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
)

// wrapMiddleware adapts a net/http middleware, such as the one idem.New
// returns, to Gin: the rest of the chain (c.Next) runs as the wrapped handler,
// writing to the middleware's ResponseWriter. When the middleware answers by
// itself (a replay, a 409, a 422) the rest of the chain does not run.
func wrapMiddleware(mw func(http.Handler) http.Handler) gin.HandlerFunc {
	return func(c *gin.Context) {
		outer := c.Writer
		mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			c.Request = r
			c.Writer = &writer{ResponseWriter: w}
			c.Next()
		})).ServeHTTP(outer, c.Request)
		c.Writer = outer
		c.Abort() // the chain ran inside, or must not run at all
	}
}

// writer is the gin.ResponseWriter over the middleware's http.ResponseWriter.
type writer struct {
	http.ResponseWriter
	status, size int
}

func (w *writer) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *writer) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	n, err := w.ResponseWriter.Write(p)
	w.size += n
	return n, err
}

func (w *writer) WriteString(s string) (int, error) { return w.Write([]byte(s)) }

func (w *writer) Status() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}

func (w *writer) Size() int {
	if w.status == 0 {
		return -1
	}
	return w.size
}

func (w *writer) Written() bool   { return w.status != 0 }
func (w *writer) WriteHeaderNow() { w.WriteHeader(w.Status()) }
func (w *writer) Flush()          { _ = http.NewResponseController(w.ResponseWriter).Flush() }
func (w *writer) Pusher() http.Pusher {
	return nil
}

// CloseNotify never fires: idem runs a claimed handler to its end whatever the
// client does.
func (w *writer) CloseNotify() <-chan bool { return make(chan bool) }

func (w *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errors.New("a keyed request cannot be hijacked: its answer is stored")
}

// auth is the Gin authentication middleware: the bearer token names the
// tenant, put into the request's context with idem.WithScope.
func auth(c *gin.Context) {
	tenant, ok := shop.Tenant(c.Request.Header)
	if !ok {
		c.AbortWithStatusJSON(http.StatusUnauthorized, gin.H{"error": "send Authorization: Bearer <tenant>"})
		return
	}
	c.Request = c.Request.WithContext(idem.WithScope(c.Request.Context(), tenant))
	c.Next()
}

func newEngine(store idem.Store, orders *shop.Orders) (*gin.Engine, error) {
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	r.Use(auth)
	r.POST("/orders", wrapMiddleware(protect), func(c *gin.Context) {
		var in shop.NewOrder
		if err := c.ShouldBindJSON(&in); err != nil {
			c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
			return
		}
		ord, err := orders.Create(idem.ScopeFrom(c.Request.Context()), in)
		if err != nil {
			c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
			return
		}
		c.Header("Location", "/orders/"+ord.ID)
		c.JSON(http.StatusCreated, ord)
	})
	r.GET("/orders", func(c *gin.Context) {
		c.JSON(http.StatusOK, gin.H{"orders": orders.List(idem.ScopeFrom(c.Request.Context()), c.Query("cart_id"))})
	})
	return r, nil
}

func main() {
	r, err := newEngine(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("Gin example: listening on http://127.0.0.1:8080")
	log.Fatal(r.Run("127.0.0.1:8080"))
}
