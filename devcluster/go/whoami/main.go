// Command kube-whoami asks the API server who the pod is, as an in-cluster client does: it
// reaches https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT (the `kubernetes` Service),
// verifies the server against the projected ServiceAccount CA, authenticates with the projected
// token and POSTs a SelfSubjectReview. It prints the reply and exits 0 on HTTP 201, 1 otherwise.
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

const account = "/var/run/secrets/kubernetes.io/serviceaccount/"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "kube-whoami:", err)
		os.Exit(1)
	}
}

func run() error {
	token, err := os.ReadFile(account + "token")
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(account + "ca.crt")
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %sca.crt", account)
	}
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return fmt.Errorf("KUBERNETES_SERVICE_HOST/PORT are not set")
	}
	client := &http.Client{
		Timeout:   20 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}},
	}
	url := "https://" + net.JoinHostPort(host, port) + "/apis/authentication.k8s.io/v1/selfsubjectreviews"
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	request, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	request.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(token)))
	request.Header.Set("Content-Type", "application/json")
	response, err := client.Do(request)
	if err != nil {
		return err
	}
	defer response.Body.Close()
	reply, err := io.ReadAll(response.Body)
	if err != nil {
		return err
	}
	fmt.Println(string(reply))
	if response.StatusCode != http.StatusCreated {
		return fmt.Errorf("%s answered %s", url, response.Status)
	}
	return nil
}
