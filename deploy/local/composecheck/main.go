// Command composecheck loads a compose file the way `docker compose config` does,
// with the Compose specification's own loader (github.com/compose-spec/compose-go/v2):
// the project directory is the compose file's, the `.env` next to it and the
// environment feed ${...} interpolation, the file is validated against the schema
// and checked for consistency, relative paths are resolved. It prints the resolved
// project as JSON on stdout (the shape of `docker compose config --format json`),
// or compose-go's own error on stderr and exits 1. tests/test_compose_config.py
// asserts on that output, so docker-compose.yml is checked without a Docker engine.
//
//	composecheck [-f docker-compose.yml] [--env KEY=VALUE ...]
//
// --env sets or overrides one variable for interpolation (it wins over the
// environment, which wins over .env, as in Compose). The loader is pinned by
// go.mod and go.sum beside this file.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

// envFlags collects repeated --env KEY=VALUE flags.
type envFlags []string

func (e *envFlags) String() string { return strings.Join(*e, ",") }

func (e *envFlags) Set(v string) error {
	if k, _, ok := strings.Cut(v, "="); !ok || k == "" {
		return fmt.Errorf("want KEY=VALUE, got %q", v)
	}
	*e = append(*e, v)
	return nil
}

func main() {
	file := flag.String("f", "docker-compose.yml", "compose file to load")
	var env envFlags
	flag.Var(&env, "env", "KEY=VALUE for interpolation, over the environment and .env (repeatable)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: composecheck [-f docker-compose.yml] [--env KEY=VALUE ...]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}

	path, err := filepath.Abs(*file)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// The options of docker compose's own ToProject: project directory, environment,
	// the default .env, then names and profiles. WithEnv comes first because neither
	// WithOsEnv nor WithDotEnv overrides a variable that is already set.
	opts, err := cli.NewProjectOptions([]string{path},
		cli.WithWorkingDirectory(filepath.Dir(path)),
		cli.WithEnv(env),
		cli.WithOsEnv,
		cli.WithEnvFiles(),
		cli.WithDotEnv,
		cli.WithConfigFileEnv,
		cli.WithDefaultProfiles(),
		cli.WithInterpolation(true),
		cli.WithNormalization(true),
		cli.WithConsistency(true),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Stdout.Write(append(out, '\n'))
}
