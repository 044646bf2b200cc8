// Command echo serves POST /orders with Echo, idem in front of the handler
// through echo.WrapMiddleware and the tenant from an Echo authentication
// middleware.
//
//	go run ./examples/routers/echo
package main

import (
	"log"
	"net/http"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"github.com/labstack/echo/v4"
)

// auth is the Echo authentication middleware: the bearer token names the
// tenant, put into the request's context with idem.WithScope.
func auth(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		tenant, ok := shop.Tenant(c.Request().Header)
		if !ok {
			return echo.NewHTTPError(http.StatusUnauthorized, "send Authorization: Bearer <tenant>")
		}
		c.SetRequest(c.Request().WithContext(idem.WithScope(c.Request().Context(), tenant)))
		return next(c)
	}
}

// renderErrors writes a handler's returned error inside idem. Echo renders
// returned errors after the whole middleware chain has returned — after idem
// stored the (then empty) answer — so a route behind echo.WrapMiddleware(idem)
// must render its errors itself; this middleware, placed after idem, does it.
func renderErrors(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if err := next(c); err != nil {
			c.Error(err)
		}
		return nil
	}
}

func newServer(store idem.Store, orders *shop.Orders) (*echo.Echo, error) {
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.Use(auth)
	e.POST("/orders", func(c echo.Context) error {
		var in shop.NewOrder
		if err := c.Bind(&in); err != nil {
			return err
		}
		ord, err := orders.Create(idem.ScopeFrom(c.Request().Context()), in)
		if err != nil {
			return echo.NewHTTPError(http.StatusBadRequest, err.Error())
		}
		c.Response().Header().Set("Location", "/orders/"+ord.ID)
		return c.JSON(http.StatusCreated, ord)
	}, echo.WrapMiddleware(protect), renderErrors)
	e.GET("/orders", func(c echo.Context) error {
		return c.JSON(http.StatusOK, map[string][]shop.Order{"orders": orders.List(idem.ScopeFrom(c.Request().Context()), c.QueryParam("cart_id"))})
	})
	return e, nil
}

func main() {
	e, err := newServer(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("Echo example: listening on http://127.0.0.1:8080")
	log.Fatal(e.Start("127.0.0.1:8080"))
}
